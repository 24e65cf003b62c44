"""What kvcx needs of transformers is checked as features, not versions: a newer release runs, a release that
lacks something kvcx uses is refused naming it."""
import pytest

from kvcx import deps
from kvcx.errors import ModelError


def test_features_not_versions(monkeypatch):
    transformers = pytest.importorskip("transformers")
    deps.check_transformers(transformers.__version__)            # the installed one has everything
    deps.check_transformers("99.0")                              # no upper bound
    with pytest.raises(ModelError, match="older than kvcx needs"):
        deps.check_transformers("4.57.0")
    monkeypatch.setattr(deps, "TRANSFORMERS_FEATURES", deps.TRANSFORMERS_FEATURES + (
        ("transformers.cache_utils", "QuantumLayer", "a test"), ))
    with pytest.raises(ModelError, match="has no transformers.cache_utils.QuantumLayer, which kvcx uses for a test"):
        deps.check_transformers("99.0")
    monkeypatch.setattr(deps, "TRANSFORMERS_FEATURES", (("transformers.no_such_module", "X", "a test"),))
    with pytest.raises(ModelError, match="no_such_module.X"):
        deps.check_transformers("99.0")
