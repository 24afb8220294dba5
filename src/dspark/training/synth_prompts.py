"""Synthesised training prompts for the domains a drafter is judged on: math, code and chat.

The prompt pool in ../shared (task data of an eval suite) has few grade-school word problems, programming
tasks or open-ended requests, while users (and the benchmark sets) ask mostly those. A drafter learns the
target's *style* of answering, so we add prompts of those kinds, made from templates and word lists with a
seeded generator: deterministic, no benchmark text, any size. The answers still come from the target.

    python -m dspark.training synth-prompts --out data/synth.jsonl --count 6000 --seed 0
"""
from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apples", 0.5, 3), ("notebooks", 2, 6), ("pencils", 0.25, 2), ("tickets", 8, 30), ("cupcakes", 1.5, 4),
         ("books", 7, 25), ("stickers", 0.1, 1), ("shirts", 9, 40), ("plants", 4, 15), ("marbles", 0.05, 0.5)]
PLACES = ["the store", "the market", "a bakery", "the school fair", "an online shop", "the library sale"]


def _money(rng: random.Random, lo: float, hi: float) -> float:
    return round(rng.uniform(lo, hi) * 4) / 4 or 0.25


def _math(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, lo, hi = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 15), rng.randint(2, 9)
    price, pct = _money(rng, lo, hi), rng.choice([10, 15, 20, 25, 30, 40, 50])
    speed, hours = rng.randint(20, 90), rng.randint(2, 9)
    problems = [
        f"{name} buys {a} {item} at {rng.choice(PLACES)} for ${price:.2f} each and pays with a "
        f"${(a * price // 10 + 1) * 10:.0f}"
        f" bill. How much change does {name} get?",
        f"{name} has {a} {item}. {other} has {b} times as many. They give away {c} each. How many {item} do they "
        f"have together now?",
        f"A {item[:-1]} costs ${price:.2f}. During a sale everything is {pct}% off. How much do {a} of them cost?",
        f"A train travels at {speed} km/h for {hours} hours, then at {speed + b} km/h for {c} more hours. "
        f"How far does it travel in total?",
        f"{name} is {a} years old. {other} is {b} years older than half of {name}'s age. How old will {other} "
        f"be in {c} years?",
        f"A rectangle is {a} cm long and {b} cm wide. What is its area, and what is its perimeter?",
        f"Solve for x: {b}x + {a} = {b * c + a}. Show your steps.",
        f"What is the sum of all integers from 1 to {a * 10}? Explain how you got it.",
        f"{name} saves ${b} every week. How many weeks does it take to save ${a * b + c}?",
        f"Find the derivative of f(x) = {c}x^{rng.randint(2, 5)} + {b}x^2 - {a}x + {c}.",
        f"A bag has {a} red and {b} blue marbles. What is the probability of drawing a blue one? Give a fraction.",
        f"What is {pct}% of {a * 20}? Then increase the result by {c * 5}%.",
        f"Simplify the fraction {a * c}/{b * c} and write it as a decimal rounded to two places.",
        f"{name} reads {b} pages a day. The book has {a * 12} pages. How many days until {name} finishes?",
    ]
    tail = rng.choice(["", " Think step by step.", " Show your reasoning, then give the final answer.",
                       " Please explain each step."])
    return rng.choice(problems) + tail


TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "finds the longest common prefix of a list of strings", "checks whether a string is a palindrome",
    "computes the factorial of n", "flattens a nested list", "returns the most frequent element of a list",
    "converts a Roman numeral to an integer", "converts an integer to binary without built-ins",
    "implements binary search on a sorted list", "computes the greatest common divisor of two numbers",
    "groups words that are anagrams of each other", "rotates a matrix by 90 degrees",
    "validates balanced parentheses in a string", "computes a running average of a list",
    "parses a CSV line into fields, respecting quotes", "finds the second largest number in a list",
    "sorts a list of dictionaries by a given key", "counts word frequencies in a text",
    "returns all permutations of a list", "checks whether two strings are anagrams",
    "implements a stack with push, pop and peek", "implements a queue using two stacks",
    "finds the maximum subarray sum", "transposes a matrix", "computes the dot product of two vectors",
    "converts Celsius to Fahrenheit for a list of values", "finds all pairs in a list that sum to a target",
    "capitalizes the first letter of every word", "checks whether a year is a leap year",
    "computes the median of a list", "splits a list into chunks of size k", "merges two dictionaries",
    "finds the missing number in a list from 1 to n", "implements bubble sort", "implements quicksort",
    "computes the edit distance between two strings", "checks whether a binary tree is balanced",
    "returns the level-order traversal of a binary tree", "detects a cycle in a linked list",
    "implements an LRU cache", "computes prime numbers up to n with a sieve",
    "compresses a string with run-length encoding",
    "finds the first non-repeating character of a string", "validates an email address with a regular expression",
]
LANGUAGES = ["Python"] * 6 + ["JavaScript", "C++", "Java", "Go", "Rust", "TypeScript"]


def _code(rng: random.Random) -> str:
    task, lang = rng.choice(TASKS), rng.choice(LANGUAGES)
    forms = [
        f"Write a {lang} function that {task}.",
        f"Write a {lang} function that {task}. Include a docstring and a few test cases.",
        f"Implement a function in {lang} that {task}, and explain its time complexity.",
        f"I need a {lang} snippet that {task}. Keep it short and readable.",
        f"Here is my task: write code that {task}. Use {lang} and add comments.",
        f"Explain how to write a program that {task}, then give the {lang} code.",
    ]
    return rng.choice(forms)


TOPICS = [
    "photosynthesis", "the water cycle", "inflation", "machine learning", "black holes", "the French Revolution",
    "climate change", "vaccines", "blockchain", "the stock market", "sleep", "time management", "public speaking",
    "learning a new language", "healthy eating", "renewable energy", "the Roman Empire", "DNA", "volcanoes",
    "remote work", "meditation", "electric cars", "the internet", "democracy", "compound interest", "gravity",
    "recycling", "social media", "coffee", "urban gardening", "job interviews", "writing a resume", "saving money",
    "the immune system", "quantum computing", "the Moon landing", "bees", "earthquakes", "chess", "jazz music",
]


def _chat(rng: random.Random) -> str:
    topic, other = rng.sample(TOPICS, 2)
    forms = [
        f"Explain {topic} to a ten-year-old.", f"What are the main advantages and disadvantages of {topic}?",
        f"Write a short essay about {topic}.", f"Give me five practical tips about {topic}.",
        f"Compare {topic} and {other}. How are they related, if at all?",
        f"Write a short poem about {topic}.", f"Summarize the history of {topic} in a few paragraphs.",
        f"What are common misconceptions about {topic}?",
        f"Write a friendly email inviting a friend to a talk on {topic}.",
        f"I am a beginner. How should I start learning about {topic}?",
        f"Write a product description for a board game themed around {topic}.",
        f"Give a step-by-step plan for a one-week project on {topic}.",
        f"Write a dialogue between a teacher and a student about {topic}.",
    ]
    return rng.choice(forms)


DOMAINS = {"math": _math, "code": _code, "chat": _chat}


def synthesize(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct prompts, the domains in turn: [{"turns": [...], "source": "synth:<domain>"}]."""
    rng, seen, out = random.Random(seed), set(), []
    kinds = list(DOMAINS)
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"only {len(out)} distinct prompts could be made; ask for fewer")
        kind = kinds[len(out) % len(kinds)]
        text = DOMAINS[kind](rng)
        if text not in seen:
            seen.add(text)
            out.append({"turns": [text], "source": f"synth:{kind}", "id": f"synth-{seed}-{len(out)}"})
    return out


def interleave(synth: list[dict], other_file: str | Path, seed: int = 0) -> list[dict]:
    """synth[0], other[0], synth[1], other[1], ...: `other` is a seeded shuffle of another prompt file, cut to
    len(synth) — so a time-boxed datagen over the result always holds both kinds in equal parts."""
    with open(other_file, encoding="utf-8") as f:
        other = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(other)
    out = []
    for a, b in zip(synth, other[: len(synth)]):
        out += [a, b]
    return out


def write_prompts(path: str | Path, count: int, seed: int = 0, interleave_with: str | Path | None = None) -> int:
    records = synthesize(count, seed)
    if interleave_with:
        records = interleave(records, interleave_with, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)
    return len(records)
