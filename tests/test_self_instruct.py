"""jaxspec.self_instruct: the training prompts are a seeded, reproducible draw from the task
templates, topics, coding tasks and word problems written in the module (nothing else), and the
stage-2 prompts wrap the target's own answers, cut to size, in every passage task."""

import json
import pathlib

import pytest

from jaxspec import self_instruct

TOPIC_PROMPTS = {kind: {template.format(topic=topic) for template in templates for topic in self_instruct.TOPICS}
                 for kind, templates in self_instruct.TEMPLATES.items()}
CODING_PROMPTS = {template.format(task=task) for template in self_instruct.CODING_TEMPLATES
                  for task in self_instruct.CODING_TASKS}


def kind_of(prompt: str) -> str:
    """Which stage-1 source a prompt came from; a word problem names a person and an item."""
    for kind, prompts in TOPIC_PROMPTS.items():
        if prompt in prompts:
            return kind
    if prompt in CODING_PROMPTS:
        return "coding"
    if any(name in prompt for name in self_instruct.NAMES) or "A class of" in prompt:
        if any(item in prompt for item in self_instruct.ITEMS) or "kilometres" in prompt:
            return "word_problem"
    raise AssertionError(f"a prompt from nowhere: {prompt!r}")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return self_instruct.topic_prompts(640)


def test_topic_prompts_are_a_reproducible_draw_of_distinct_prompts(prompts):
    assert len(prompts) == 640 and len(set(prompts)) == 640
    assert all(prompt.strip() for prompt in prompts)
    assert self_instruct.topic_prompts(640) == prompts
    other_seed = self_instruct.topic_prompts(640, seed=1)
    assert other_seed != prompts and len(set(other_seed)) == 640
    assert self_instruct.topic_prompts(1, seed=3) == self_instruct.topic_prompts(1, seed=3)


def test_topic_prompts_mix_every_task_kind_and_come_from_nowhere_else(prompts):
    kinds = {kind_of(prompt) for prompt in prompts}
    assert kinds == set(self_instruct.TEMPLATES) | {"coding", "word_problem"}


@pytest.mark.parametrize("count", [0, -1, 10 ** 6])
def test_a_count_outside_the_pool_is_refused(count):
    with pytest.raises(ValueError, match="count must be in"):
        self_instruct.topic_prompts(count)


def test_article_prompts_are_the_prose_about_a_topic(prompts):
    topic = self_instruct.TOPICS[0]
    assert self_instruct.is_article_prompt(f"Write a short blog post about {topic}.")
    assert self_instruct.is_article_prompt(f"Explain {topic} to a high school student.")
    assert not self_instruct.is_article_prompt(f"Write a short poem about {topic}.")  # not a passage
    assert not self_instruct.is_article_prompt(f"What is {topic}?")
    assert not self_instruct.is_article_prompt(next(iter(CODING_PROMPTS)))
    articles = [prompt for prompt in prompts if self_instruct.is_article_prompt(prompt)]
    assert len(articles) > 100  # enough stage-1 answers to serve as stage-2 passages
    assert {kind_of(prompt) for prompt in articles} == {"writing", "stem_humanities"}


ARTICLE = "Bees make honey. " * 60  # 1020 characters of 17-character sentences
SECOND = "Volcanoes erupt when pressure builds beneath the crust, and the magma rises. " * 3  # 231 characters


def test_passage_prompts_wrap_each_passage_in_turn_then_reuse_them():
    wrapped = self_instruct.passage_prompts([ARTICLE, "too short", SECOND], 8)
    assert len(wrapped) == 8
    # The passages long enough (120 characters) come first, in order, one per template.
    assert "Bees make honey." in wrapped[0] and "Volcanoes erupt" in wrapped[1]
    assert all(("Bees make honey." in p) != ("Volcanoes erupt" in p) for p in wrapped)
    assert not any("too short" in p for p in wrapped)
    templates = [t for group in self_instruct.PASSAGE_TEMPLATES.values() for t in group]
    assert len(templates) == 6
    for prompt, template in zip(wrapped, templates):
        head = template.split("{passage}")[0]
        assert prompt.startswith(head), (prompt[:60], head)
    assert self_instruct.passage_prompts([ARTICLE, SECOND], 8, seed=5) == \
        self_instruct.passage_prompts([ARTICLE, SECOND], 8, seed=5)


def test_a_long_passage_is_cut_at_a_sentence_end_within_max_chars():
    [prompt] = self_instruct.passage_prompts([ARTICLE], 1, max_chars=300)
    passage = prompt.split("\n\n", 1)[1]
    # Sentence n ends at character 17n - 1: the 17th at 288 <= 300, the 18th at 305.
    assert passage == ("Bees make honey. " * 17).strip()
    [untouched] = self_instruct.passage_prompts([SECOND], 1)
    assert SECOND.strip() in untouched


def test_passage_prompts_need_one_long_enough_passage():
    with pytest.raises(ValueError, match="no passage is long enough"):
        self_instruct.passage_prompts(["short", "x" * 119], 2)


def test_no_training_prompt_is_a_spec_bench_question(prompts):
    # Spec-Bench is the held-out evaluation set (bench/data/spec_bench): no prompt may come from it.
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "data" / "spec_bench" / "question.jsonl"
    questions = {turn.strip() for line in path.read_text().splitlines() if line.strip()
                 for turn in json.loads(line)["turns"]}
    assert len(questions) > 480  # 480 questions, the MT-bench ones with two turns: the file was read
    assert not questions & {prompt.strip() for prompt in prompts}
