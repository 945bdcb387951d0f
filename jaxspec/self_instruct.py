"""Training prompts for draft heads, written from a topic list kept here (self-instruct style).

The shipped EAGLE-3 head for SmolLM2-135M-Instruct learned from these prompts, answered by the
target itself. Nothing here comes from a dataset: the topics, tasks and templates below were
written for jaxspec (Apache-2.0, like the rest of the repository), so the data can be rebuilt on
a fresh machine with no download and no licence question. None of it is taken from Spec-Bench,
which stays the evaluation set.

Two stages, both answered by the target (`train.self_distill`):

1. `topic_prompts`: task templates crossed with topics and small generated problems. The task
   kinds mirror what a chat model is asked (and what Spec-Bench measures): writing, roleplay,
   reasoning, arithmetic word problems, coding, STEM and humanities explanations, short QA.
2. `passage_prompts`: the target's own stage-1 articles become passages for summarisation,
   extraction, question answering over a context, and translation prompts. These teach the head
   what it sees when the answer copies from the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxspec.errors import InvalidRequestError

TOPICS = (
    # science and technology
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes", "climate change",
    "renewable energy", "solar panels", "electric cars", "the human immune system", "vaccines",
    "DNA and genes", "the theory of evolution", "the periodic table", "magnetism", "electricity",
    "the speed of light", "gravity", "the solar system", "the Moon landing", "Mars exploration",
    "artificial intelligence", "machine learning", "the internet", "computer networks", "encryption",
    "databases", "operating systems", "smartphones", "3D printing", "robots", "quantum computers",
    "bridges", "airplanes", "bicycles", "batteries", "recycling", "ocean currents", "coral reefs",
    "rainforests", "honeybees", "dinosaurs", "the human heart", "sleep", "nutrition", "exercise",
    # society, history and culture
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "the French Revolution", "the Silk Road", "the Renaissance", "democracy", "taxes", "inflation",
    "the stock market", "small businesses", "remote work", "public transport", "city planning",
    "libraries", "museums", "classical music", "jazz", "film making", "photography", "poetry",
    "the Olympic Games", "football", "chess", "cooking pasta", "baking bread", "coffee", "tea",
    "gardening", "camping", "travelling on a budget", "learning a new language", "time management",
    "public speaking", "friendship", "volunteering", "saving money", "job interviews", "pets",
)

# One list per task kind; "{topic}" is filled from TOPICS.
TEMPLATES = {
    "writing": (
        "Write a short blog post about {topic}.",
        "Write a persuasive paragraph explaining why people should care about {topic}.",
        "Write a short poem about {topic}.",
        "Write an engaging introduction for a magazine article on {topic}.",
    ),
    "roleplay": (
        "Pretend you are a museum guide. Explain {topic} to a group of visitors.",
        "You are a friendly teacher. Introduce {topic} to a class of ten-year-olds.",
        "Act as an expert being interviewed on the radio about {topic}. Answer the host's first question.",
    ),
    "reasoning": (
        "What are the main advantages and disadvantages of {topic}? Think it through step by step.",
        "What would happen if {topic} suddenly disappeared from the world? Reason carefully.",
        "Compare {topic} today with how it was a hundred years ago.",
    ),
    "stem_humanities": (
        "Explain {topic} to a high school student.",
        "What are three common misconceptions about {topic}?",
        "Give a brief history of {topic}.",
        "Describe how {topic} works, in simple terms.",
    ),
    "qa": (
        "What is {topic}?",
        "Why is {topic} important?",
        "Give me five interesting facts about {topic}.",
    ),
}

CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "finds the largest element of a list", "sorts a list of words by length",
    "removes duplicates from a list while keeping the order", "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "computes the factorial of a number", "merges two sorted lists",
    "counts how often each word appears in a text", "computes the average of a list of numbers",
    "returns the greatest common divisor of two integers", "flattens a nested list",
    "checks whether two strings are anagrams", "converts a decimal number to binary",
    "finds the second smallest number in a list", "capitalises the first letter of every word",
    "implements binary search on a sorted list", "reads a text file and counts its lines",
    "returns the sum of the digits of an integer", "transposes a matrix given as a list of lists",
    "validates that a string is a simple email address",
)
CODING_TEMPLATES = (
    "Write a Python function that {task}. Explain how it works.",
    "Write a JavaScript function that {task}.",
    "How would you write a function that {task}? Show the code and test it on an example.",
)

ITEMS = ("apples", "pencils", "books", "tickets", "cookies", "notebooks", "bottles of water", "plants")
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo")

PASSAGE_TEMPLATES = {
    "summarization": (
        "Summarize the following text in two or three sentences.\n\n{passage}",
        "Write a one-paragraph summary of this article:\n\n{passage}",
    ),
    "extraction": (
        "List the key facts mentioned in the following text as bullet points.\n\n{passage}",
    ),
    "rag": (
        "Use the passage below to answer the question.\n\nPassage: {passage}\n\nQuestion: What is the main idea of the passage?",
        "Read the text and answer: which details in it would surprise most readers?\n\n{passage}",
    ),
    "translation": (
        "Translate the following text into French.\n\n{passage}",
    ),
}


def _word_problem(rng: np.random.Generator) -> str:
    name, other = rng.choice(NAMES, size=2, replace=False)
    item = rng.choice(ITEMS)
    count, price, given = int(rng.integers(3, 40)), int(rng.integers(2, 15)), int(rng.integers(1, 3))
    kinds = (
        f"{name} buys {count} {item} at ${price} each and pays with a $500 bill. How much change does "
        f"{name} get? Solve it step by step.",
        f"{name} has {count} {item} and gives {other} a {given}/{given + 2} share of them, rounded down. "
        f"How many {item} does {name} keep? Show your reasoning.",
        f"A class of {count} students needs {price} {item} each. {item.capitalize()} come in boxes of 12. "
        "How many boxes are needed? Explain step by step.",
        f"{name} walks {price} kilometres a day for {count} days, then twice as far for 3 more days. "
        "How far did they walk in total? Think step by step.",
    )
    return kinds[int(rng.integers(len(kinds)))]


def topic_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct stage-1 prompts, a seeded draw over every (kind, template, topic), coding
    task and word problem: the same (count, seed) always gives the same list."""
    rng = np.random.default_rng([seed, 0x5E1F])
    pool = [template.format(topic=topic) for templates in TEMPLATES.values() for template in templates
            for topic in TOPICS]
    pool += [template.format(task=task) for template in CODING_TEMPLATES for task in CODING_TASKS]
    pool += [_word_problem(rng) for _ in range(len(TOPICS) * 2)]
    pool = list(dict.fromkeys(pool))  # drop repeated word problems, keep the order
    if not 1 <= count <= len(pool):
        raise InvalidRequestError(f"count must be in [1, {len(pool)}]; got {count}")
    order = rng.permutation(len(pool))[:count]
    return [pool[i] for i in order]


def is_article_prompt(prompt: str) -> bool:
    """Whether a stage-1 prompt asks for prose about a topic (its answer can serve as a passage)."""
    prose = TEMPLATES["writing"][:2] + TEMPLATES["writing"][3:] + TEMPLATES["stem_humanities"]
    return any(prompt == template.format(topic=topic) for template in prose for topic in TOPICS)


def passage_prompts(passages: Sequence[str], count: int, seed: int = 0, max_chars: int = 700) -> list[str]:
    """`count` stage-2 prompts: each wraps one of the target's own answers (cut at a sentence end
    within `max_chars`) in a summarisation, extraction, reading-comprehension or translation task."""
    rng = np.random.default_rng([seed, 0x9A55])
    cut = []
    for passage in passages:
        text = passage.strip()
        if len(text) > max_chars:
            end = text.rfind(". ", 0, max_chars)
            text = text[: end + 1] if end > max_chars // 3 else text[:max_chars]
        if len(text) >= 120:  # too short to summarise
            cut.append(text)
    if not cut:
        raise InvalidRequestError("no passage is long enough (120 characters) to build a stage-2 prompt from")
    templates = [template for group in PASSAGE_TEMPLATES.values() for template in group]
    prompts = []
    for index in range(count):
        passage = cut[int(rng.integers(len(cut)))] if index >= len(cut) else cut[index]
        prompts.append(templates[index % len(templates)].format(passage=passage))
    return prompts
