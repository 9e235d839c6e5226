"""drkernel: a readable, single-process implementation of Dr. Kernel.

Data flow (see train.py): tasks -> prompts -> rollout -> sandbox/evaluator -> rewards
-> advantages -> loss -> trainer. Modules are imported lazily by the scripts so that
`import drkernel` stays cheap (the sandbox's fork server imports only what it needs).
"""

import os

# On a small shared CPU, OpenMP threads that spin while waiting take the cores from the threads
# doing the work: a SmolLM2 decode step with 2 threads took 6.3 s instead of 0.5 s under load.
# Waiting threads that sleep remove that. Set before torch is imported; an explicit value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
