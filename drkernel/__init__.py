"""drkernel: a readable, single-process implementation of Dr. Kernel.

Data flow (see train.py): tasks -> prompts -> rollout -> sandbox/evaluator -> rewards
-> advantages -> loss -> trainer. Modules are imported lazily by the scripts so that
`import drkernel` stays cheap (the sandbox's fork server imports only what it needs).
"""

__version__ = "0.1.0"
