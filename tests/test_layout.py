"""Package layout: what importing a part of specdec loads. The model-free tools (``diagnose``, ``simulate``)
must not load torch or transformers, and ``diagnose`` not the engine; the simulator runs the engine's own step,
whose module loads no torch (the target model's side of the step, ``specdec.verifier``, does); ``specdec``'s
public names still resolve on first use.

Each check runs in a fresh interpreter: this test process has long imported torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "specdec.engine")


def loaded_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a new interpreter; which of HEAVY it left in ``sys.modules``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


NOTHING = dict.fromkeys(HEAVY, False)


def test_import_specdec_loads_no_torch_and_knows_its_version() -> None:
    assert loaded_after("import specdec\nassert specdec.__version__ and specdec.__version__[0].isdigit()") == NOTHING


def test_import_diagnose_loads_no_torch() -> None:
    assert loaded_after("import specdec.diagnose, specdec.diagnose.html, specdec.trace, specdec.analysis") == NOTHING


def test_diagnose_command_loads_no_torch(tmp_path: Path) -> None:
    from specdec.diagnose.synthetic import write_synthetic_trace

    trace = write_synthetic_trace(tmp_path / "t.jsonl", "healthy", requests=2, steps_per_request=5)
    code = f"from specdec.cli import main\nassert main(['diagnose', {str(trace)!r}, '--json']) == 0"
    assert loaded_after(code) == NOTHING


def test_import_simulate_loads_no_torch() -> None:
    code = (
        "import specdec.simulate.goals\nfrom specdec.cli import main\n"
        "assert main(['simulate', '--workload', 'iid-0.8', '--requests', '2', '--seeds', '1']) == 0\n"
        "assert main(['simulate', '--workload', 'load-0.8', '--requests', '4', '--seeds', '1', '--policy', "
        "'adaptive', '--arrivals', 'clients:2']) == 0"
    )
    assert loaded_after(code) == {**NOTHING, "specdec.engine": True}  # the engine's step, on the simulated pair


def test_the_engine_step_loads_no_torch_until_a_model_target_is_made() -> None:
    assert loaded_after("import specdec.engine\nimport specdec.sampling_params") == {
        **NOTHING,
        "specdec.engine": True,
    }


def test_public_names_resolve_on_first_use() -> None:
    import specdec
    import specdec.engine
    import specdec.records

    assert specdec.Engine is specdec.engine.Engine
    assert specdec.StepRecord is specdec.records.StepRecord
    assert set(specdec.__all__) == set(specdec._EXPORTS) and set(specdec.__all__) <= set(dir(specdec))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = specdec.no_such_name  # type: ignore[attr-defined]
    loaded = loaded_after("import specdec\nspecdec.load")
    assert loaded["torch"] and loaded["specdec.engine"]  # reading a name loads what defines it
