"""The loadtest's multi-model servers (F33, F34, F35, F36): the harness starts `serve --models`
with a budget, and the budgets make the scenarios mean what they say (code + one draft fit,
not code + two; the small pair fits, code never does)."""

from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast_harness.loadtest.harness import ServerSpec
from ultrafast_harness.loadtest.runner import select
from ultrafast_harness.loadtest.scenarios_models import (
    engine_death_spec,
    fault_spec,
    model_bytes,
    swap_spec,
)


def test_a_models_spec_passes_models_and_budget_instead_of_the_model():
    spec = ServerSpec(executor="demo", models=(("a", "/m/a"), ("b", "/m/b")), max_resident_bytes=99)
    argv = spec.argv(8123)
    assert str(DEMO_MODEL_DIR) not in argv
    i = argv.index("--models")
    assert argv[i + 1] == "a=/m/a,b=/m/b"
    assert argv[argv.index("--max-resident-bytes") + 1] == "99"
    assert "--executor" not in argv
    plain = ServerSpec().argv(8123)
    assert str(DEMO_MODEL_DIR) in plain and "--models" not in plain
    assert "--max-resident-bytes" not in ServerSpec(models=(("a", "/m/a"),)).argv(1)


def test_the_swap_budget_fits_the_streaming_model_and_one_other():
    spec = swap_spec()
    code, draft = model_bytes(DEMO_MODEL_DIR), model_bytes(DEMO_DRAFT_DIR)
    assert [name for name, _ in spec.models] == ["code", "b", "c"]
    assert code + draft <= spec.max_resident_bytes < code + 2 * draft


def test_the_fault_budget_fits_the_small_pair_and_never_code():
    spec = fault_spec()
    paths = dict(spec.models)
    assert list(paths) == ["small", "gone", "code"]
    assert model_bytes(paths["small"]) + model_bytes(paths["gone"]) <= spec.max_resident_bytes
    assert model_bytes(paths["code"]) > spec.max_resident_bytes
    assert fault_spec() == spec  # one server serves F36 and F34


def test_the_model_faults_run_in_the_ci_matrix():
    names = [sc.name for sc in select("ci")]
    assert {"F33", "F34", "F35", "F36"} <= set(names)


def test_the_engine_death_budget_makes_each_model_evict_the_other():
    spec = engine_death_spec()
    sizes = [model_bytes(path) for _, path in spec.models]
    assert spec.executor == "fake" and len(sizes) == 2  # the fake executor can be told to die
    assert max(sizes) <= spec.max_resident_bytes < sum(sizes)
