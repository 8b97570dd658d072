"""The calculator task: disjoint generated splits, exact answers, demonstrations as whole tool
episodes, and the tag format of the tools the default workflow runs."""

from areal_async.config import DataConfig
from areal_async.data import load_task
from areal_async.data.calc import KINDS, TEST_PER_KIND, generate_splits
from areal_async.tools import ToolSet


def test_the_splits_are_disjoint_and_every_test_prefix_covers_every_kind():
    splits = generate_splits()
    seen = [set(splits[name]) for name in ("train", "test", "demos")]
    assert sum(map(len, seen)) == len(set().union(*seen)) == 8100 + 4095 + 720
    assert len(splits["test"]) == TEST_PER_KIND * len(KINDS)
    assert [kind for kind, _, _ in splits["test"][:3]] == list(KINDS)
    assert generate_splits() == splits, "a pure function of the seed"


def test_items_have_exact_answers_and_a_demonstration_is_a_tool_episode():
    task = load_task(DataConfig(task="calc", few_shot=1), "test")
    for i in range(6):
        row = task.item(i).row
        a, b = row["operands"]
        assert int(task.gold(i)) == {"add": a + b, "sub": a - b, "mul": a * b}[row["kind"]]
    system, question, call, result, answer, item = task.messages(0)
    assert system["role"] == "system" and ToolSet(["calculator"]).system_prompt() in system["content"]
    assert call["role"] == "assistant" and ToolSet(["calculator"]).parse(call["content"]) is not None
    assert result == {"role": "tool", "content": f"<result>\n{answer['content'].split('{')[1].split('}')[0]}\n</result>"}
    assert item["role"] == "user" and item["content"].startswith(task.item(0).row["prompt"])
    assert len(load_task(DataConfig(task="calc", few_shot=0), "test").messages(0)) == 2
