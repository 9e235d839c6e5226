"""Multi-turn generation for KernelBench problems with an HF model: `python generate.py ...`.

Not implemented yet (issue 6); it will reuse drkernel.rollout and drkernel.prompts, the same
code path as training. This script says so plainly instead of pretending to generate.
"""

import sys


def main() -> int:
    print("generate.py: not implemented yet (issue 6).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
