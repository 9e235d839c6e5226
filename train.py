"""RL (and later SFT) training entry point: `accelerate launch train.py [--config cfg.yaml] [--key value ...]`.

Not implemented yet: the RL loop is tracked in issue 5 and SFT in issue 8. The pieces it
will wire together already exist and are tested: drkernel.tasks, drkernel.prompts,
drkernel.rollout, drkernel.evaluator, drkernel.rewards, drkernel.advantages, drkernel.loss.
This script says so plainly instead of pretending to train.
"""

import sys


def main() -> int:
    print("train.py: the RL/SFT training loop is not implemented yet (issues 5 and 8). "
          "Use `python evaluate.py` or `python -m drkernel.evaluator` meanwhile.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
