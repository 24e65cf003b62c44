"""kvcx validate's request, checked by the quality wing before any model loads (kvcx.quality.request): each option
that does not go with the task is a KvcxError naming it and the fix; what passes parses its numbers."""
import pytest

from kvcx.errors import KvcxError
from kvcx.quality.request import ValidateRequest


@pytest.mark.parametrize("fields,message", [
    ({"task": "speed"}, "--task 'speed' must be perplexity, ruler or passkey"),
    ({"lengths": "1024"}, "--lengths sets the retrieval tasks' prompts"),
    ({"query_aware": True}, "--query-aware sets the retrieval tasks' prompts"),
    ({"task": "passkey", "tasks": "vt"}, "--tasks picks ruler's tasks"),
    ({"task": "passkey", "tolerance": 1}, "--tolerance was replaced by a paired test"),
    ({"task": "ruler", "backend": "cpu"}, "--backend chooses where"),
    ({"quick_test": True, "backend": "cpu"}, "--backend chooses where"),
    ({"quick_test": True, "pressed": ("kvcx+snapkv:0.5",)}, "--scheme kvcx\\+snapkv:0.5: a press reads"),
    ({"task": "ruler", "mode": "engine"}, "--task ruler runs in prefix mode"),
    ({"task": "passkey", "alpha": 1.5}, "--alpha 1.5 must be a significance level"),
    ({"task": "passkey", "lengths": "1k"}, "--lengths '1k' must be token counts"),
    ({"task": "passkey", "depths": "half"}, "--depths 'half' must be fractions"),
    ({"quick_test": True, "device": "cpu"}, "--device places a model; --quick-test has none"),
    ({"device": "auto", "mode": "generation"}, "--device auto spreads one model over the GPUs for prefix mode"),
])
def test_options_that_do_not_go_with_the_task_are_named(fields, message):
    with pytest.raises(KvcxError, match=message):
        ValidateRequest(**fields).check()


def test_a_request_that_passes_gives_its_retrieval_arguments(monkeypatch):
    r = ValidateRequest(task="ruler", tasks="vt,cwe", lengths="1024, 4096", depths="0.1,0.9", query_aware=True)
    r.check()
    assert r.retrieval and r.retrieval_tasks() == ["vt", "cwe"]
    assert r.retrieval_lengths() == [1024, 4096] and r.retrieval_depths() == [0.1, 0.9]
    assert ValidateRequest(task="passkey").retrieval_tasks() == ["passkey"]
    assert ValidateRequest().retrieval_lengths() is None and not ValidateRequest().retrieval
    ValidateRequest(quick_test=True).check()
    monkeypatch.setenv("WORLD_SIZE", "2")   # under a launcher: the quick test is refused, the gate is not
    ValidateRequest().check()
    with pytest.raises(KvcxError, match="--quick-test runs in one process"):
        ValidateRequest(quick_test=True).check()
