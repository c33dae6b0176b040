"""Write train.jsonl and validation.jsonl: arithmetic tasks with exact answers.

    python servers/resources/math/data/generate_arithmetic.py

The tasks are a pure function of the seed, so the files (and their
statistics, checked by `gym-grpc prepare-data`) only change when this does.
"""

import json
import random
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def task(rng: random.Random) -> dict:
    a, b, c = rng.randint(2, 99), rng.randint(2, 30), rng.randint(2, 12)
    first, second = rng.choice("+-*/"), rng.choice("+-*")
    value = OPERATIONS[second](OPERATIONS[first](Fraction(a), Fraction(b)), Fraction(c))
    question = f"What is ({a} {first} {b}) {second} {c}? Put the final answer in \\boxed{{}}."
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}]},
        "expected_answer": latex(value),
    }


def main() -> None:
    rng = random.Random(20261122)
    for name, count in (("train", 64), ("validation", 16)):
        rows = [task(rng) for _ in range(count)]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
