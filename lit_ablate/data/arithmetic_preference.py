"""``ArithmeticPreference``: preference pairs with a checkable signal, generated offline."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from lit_ablate.data.sources import ArithmeticSFT, DataSource, Row
from lit_ablate.errors import ConfigError

_SOURCE_KEY = "data.init_args.source.init_args"


class ArithmeticPreference(DataSource):
    """``{"prompt": "12+7=", "chosen": "19", "rejected": "21"}``: the correct answer is preferred
    over a wrong one, a fixed small distance away.

    Choose it to see preference training work on a CPU: which answer is right is a function of
    the prompt, so reward accuracy (chosen rewarded above rejected) must rise above chance as the
    policy learns, on held-out pairs too. Problems come from ``ArithmeticSFT`` (distinct, so a
    held-out split asks only unseen problems). Optional worked examples before the question
    ("3+4=7\\n...") make prompts long and their lengths skewed (log-normal count): the shape
    where packing and prefix sharing pay off.

    Args:
        num_examples: how many distinct problems (pairs).
        max_operand: operands are drawn from ``[0, max_operand]``.
        operators: which of ``+``, ``-``, ``*`` to draw from.
        max_error: the wrong answer is off by a non-zero amount in ``[-max_error, max_error]``.
        median_shots: median number of worked examples before the question (0: none).
        shots_sigma: log-normal sigma of that number (0: always ``median_shots``).
        max_shots: cap on worked examples per prompt.
        seed: the pairs are a pure function of the arguments.
    """

    def __init__(
        self,
        num_examples: int = 2000,
        max_operand: int = 50,
        operators: str = "+",
        max_error: int = 3,
        median_shots: float = 0.0,
        shots_sigma: float = 1.0,
        max_shots: int = 32,
        seed: int = 0,
    ) -> None:
        self.problems = ArithmeticSFT(
            num_examples=num_examples, max_operand=max_operand, operators=operators, seed=seed
        )
        if max_error < 1:
            raise ConfigError(f"{_SOURCE_KEY}.max_error", max_error, "use 1 or more (a wrong answer must differ)")
        if median_shots < 0 or shots_sigma < 0 or max_shots < 0:
            raise ConfigError(
                f"{_SOURCE_KEY}.median_shots",
                (median_shots, shots_sigma, max_shots),
                "median_shots, shots_sigma and max_shots must be >= 0",
            )
        self.max_error, self.seed = max_error, seed
        self.median_shots, self.shots_sigma, self.max_shots = median_shots, shots_sigma, max_shots

    def num_rows(self) -> int:
        return self.problems.num_examples

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed + 1)  # not ArithmeticSFT's stream: errors and shots are independent of problems
        rows = list(self.problems)
        solved = [f"{row['prompt']}{row['response']}" for row in rows]
        for index, row in enumerate(rows):
            answer = int(row["response"])
            error = rng.choice([e for e in range(-self.max_error, self.max_error + 1) if e])
            shots = 0
            if self.median_shots > 0:
                shots = min(self.max_shots, round(rng.lognormvariate(math.log(self.median_shots), self.shots_sigma)))
            others = (rng.randrange(len(solved) - 1) for _ in range(shots)) if len(solved) > 1 else ()
            context = "".join(f"{solved[i + (i >= index)]}\n" for i in others)  # never the question itself
            yield {"prompt": context + row["prompt"], "chosen": str(answer), "rejected": str(answer + error)}
