"""What examples/central_mlp.py prints, and the README's HttpAgent program run as written against
examples/async_http_agent.py's policy service."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # subprocesses that build envs and start workers


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_central_mlp_prints_steps_then_reward() -> None:
    done = subprocess.run(
        [sys.executable, "examples/central_mlp.py", "--episodes", "2", "--max-iter", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if " steps, reward " in line]
    assert len(lines) == 2, done.stdout
    for line in lines:  # 20 steps each (the MLP survives them), then the reward
        match = re.fullmatch(
            r"\S+: (\d+) steps, reward ([\d.]+)  \(orchestrator: (\d+), ([\d.]+)\)", line
        )
        assert match is not None, line
        assert match[1] == match[3] == "20", line
        assert float(match[2]) == float(match[4]) > 20.0, line  # not the step count


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("asyncrunner_http_agent_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_http_agent_program_runs(tmp_path: Path) -> None:
    pytest.importorskip("httpx")
    pytest.importorskip("lightsim2grid")
    [program] = [b for b in _python_blocks((ROOT / "README.md").read_text()) if "HttpAgent" in b]
    assert 'POLICY_URL = "http://127.0.0.1:8080"' in program
    service = _load(ROOT / "examples" / "async_http_agent.py")
    with service.policy_service(0.0) as url:
        script = tmp_path / "http_agent.py"
        script.write_text(program.replace("http://127.0.0.1:8080", url))
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 8 and all(0 < int(steps) <= 50 for _, steps, _ in rows), done.stdout
