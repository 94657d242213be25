"""The prompt set for self-distillation: templates x topics, written to prompts.jsonl.

Drafts learn what the target says, so the prompts only have to make the target
talk the way users make it talk: chat and writing, explanations, code,
summaries of a given passage, and arithmetic word problems. Each category
crosses a handful of templates with a list of topics (and, for math, seeded
random numbers). The set is deterministic; regenerate the shipped file with
``python -m specserve.training.prompts``. None of it overlaps the benchmark
prompts in benchmarks/prompts/.
"""
from __future__ import annotations

import itertools
import json
import os
import random

PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")

TOPICS = [
    "volcanoes", "the printing press", "honeybees", "black holes", "the Roman aqueducts", "coral reefs",
    "electric cars", "the water cycle", "jazz music", "chess openings", "the human immune system",
    "renewable energy", "the Silk Road", "octopuses", "recycling plastics", "sourdough bread",
    "the Moon landing", "earthquakes", "photosynthesis", "the stock market", "marathon training",
    "ancient Egypt", "machine learning", "the Amazon rainforest", "vaccines", "the French Revolution",
    "public libraries", "bird migration", "solar panels", "the Great Wall of China", "coffee",
    "deep sea exploration", "the history of the bicycle", "sleep", "composting", "the Olympic Games",
    "glaciers", "the internet", "dinosaurs", "urban gardening", "meditation", "the Renaissance",
    "hurricanes", "wolves", "3D printing", "the periodic table", "space telescopes", "tea ceremonies",
    "climate change", "bridges", "antibiotics", "the violin", "desert ecosystems", "cryptography",
    "the Industrial Revolution", "penguins", "board games", "rainbows", "mountain climbing", "origami",
]

CHAT_TEMPLATES = [
    "Tell me something interesting about {topic}.",
    "Write a short paragraph about {topic} for a curious ten-year-old.",
    "Write a haiku and then a four-line poem about {topic}.",
    "I'm giving a five-minute talk on {topic}. Can you give me an outline?",
    "Write a friendly message to a friend recommending they learn about {topic}.",
    "What are three common misconceptions about {topic}?",
    "Write a short story (about 100 words) that involves {topic}.",
    "Give me five fun facts about {topic}.",
    "Describe {topic} as if you were a tour guide.",
    "Write a product description for a documentary about {topic}.",
]

QA_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is the most important thing to know about {topic}? Answer in a few sentences.",
    "How does {topic} affect everyday life?",
    "What are the pros and cons of {topic}?",
    "Compare {topic} with {other}. How are they similar and different?",
    "Why do people find {topic} fascinating?",
    "What questions do scientists or historians still have about {topic}?",
    "Summarize the history of {topic} in five bullet points.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the largest element of a list", "computes the factorial of n", "merges two sorted lists",
    "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome", "computes the n-th Fibonacci number",
    "finds the most common character in a string", "flattens a nested list",
    "computes the average of a list of numbers", "validates a simple email address",
    "sorts a list of dictionaries by a key", "reads a text file and counts its lines",
    "returns the indices of two numbers that add up to a target", "capitalizes every word in a sentence",
    "computes the greatest common divisor of two numbers", "groups words by their first letter",
]
CODE_LANGUAGES = ["Python", "JavaScript", "Python", "C", "Python", "Rust", "Go", "Python"]
CODE_TEMPLATES = [
    "Write a {language} function that {task}.",
    "Write a {language} function that {task}, with a short docstring or comment and an example.",
    "How would I write code in {language} that {task}? Explain briefly.",
    "Write a {language} function that {task}, and a unit test for it.",
]

PASSAGE_SENTENCES = {
    topic: [
        f"{topic[0].upper() + topic[1:]} have been studied for a long time." if topic.endswith("s") else
        f"{topic[0].upper() + topic[1:]} has been studied for a long time.",
        f"Researchers say that {topic} tell us a lot about the world around us." if topic.endswith("s") else
        f"Researchers say that {topic} tells us a lot about the world around us.",
        f"In recent years, new tools have made it easier to learn about {topic}.",
        f"Some people first hear about {topic} in school, while others discover it through books or films.",
        f"Experts disagree about some details, but most agree that {topic} deserves more attention.",
        f"Local clubs and online groups now organize events where beginners can learn about {topic}.",
    ]
    for topic in TOPICS
}
SUMMARY_TEMPLATES = [
    "Summarize the following text in one sentence:\n\n{passage}",
    "Summarize this paragraph in two or three bullet points:\n\n{passage}",
    "Read the passage and give a short title and a one-line summary:\n\n{passage}",
    "Rewrite the following text so that it is shorter and clearer:\n\n{passage}",
]

MATH_TEMPLATES = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost? Show your steps.",
    "Tom has {a} apples and gives away {b}. Then he buys {c} more. How many apples does he have?",
    "A train travels {a} km in {b} hours. What is its average speed? Explain.",
    "What is {a} times {b}, plus {c}? Work it out step by step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If a recipe needs {b} eggs for {a} people, how many eggs are needed for {c} people?",
    "Solve for x: {a}x + {b} = {c}. Show your work.",
    "A class has {a} students and {b} percent of them like math. How many students like math?",
]


def _stratified(groups: list[list[dict]], rng: random.Random) -> list[dict]:
    """Shuffle each category, then interleave them, so any prefix of the file is balanced."""
    for g in groups:
        rng.shuffle(g)
    out = []
    for row in itertools.zip_longest(*groups):
        out.extend(p for p in row if p is not None)
    return out


def build_prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    chat = [{"category": "chat", "prompt": t.format(topic=x)} for t in CHAT_TEMPLATES for x in TOPICS]
    qa = [
        {"category": "qa", "prompt": t.format(topic=x, other=rng.choice([o for o in TOPICS if o != x]))}
        for t in QA_TEMPLATES for x in TOPICS
    ]
    code = [
        {"category": "code", "prompt": t.format(language=rng.choice(CODE_LANGUAGES), task=task)}
        for t in CODE_TEMPLATES for task in CODE_TASKS
    ]
    summ = []
    for t in SUMMARY_TEMPLATES:
        for x in TOPICS:
            sentences = rng.sample(PASSAGE_SENTENCES[x], 4)
            summ.append({"category": "summarization", "prompt": t.format(passage=" ".join(sentences))})
    math = []
    for t in MATH_TEMPLATES:
        for _ in range(20):
            a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 90)
            math.append({"category": "math", "prompt": t.format(a=a, b=b, c=c)})
    prompts = _stratified([chat, qa, code, summ, math], rng)
    return [{"id": i, **p} for i, p in enumerate(prompts)]


def load_prompts(path: str | None = None, num: int | None = None) -> list[dict]:
    """The first ``num`` prompts of a JSONL file (default: the shipped set).

    Each line has a ``prompt`` string (or ``turns``: a list whose first item is used,
    the benchmark format) and optionally a ``category``.
    """
    prompts = []
    with open(path or PROMPTS_FILE) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                text = d.get("prompt") or (d.get("turns") or [None])[0]
                if not text:
                    raise ValueError(f"a prompt line has neither 'prompt' nor 'turns': {line[:80]!r}")
                prompts.append({"category": d.get("category", ""), "prompt": text})
    return prompts[:num] if num else prompts


def main() -> None:
    prompts = build_prompts()
    with open(PROMPTS_FILE, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print(f"wrote {len(prompts)} prompts to {PROMPTS_FILE}")


if __name__ == "__main__":
    main()
