"""Every shell command of README.md's code blocks, run as written in a fresh venv on a copy of
this checkout (one venv for all, in README order), plus the README's complete Python program.

How each kind of command is run (`_plan`):
- most run to their end and must exit 0 (each within a time limit);
- servers (`python examples/web_app.py`, `uvicorn`, `jupyter notebook`, `dask scheduler`,
  `dask worker`) start in the background, must show they serve (an HTTP answer, or the line
  they print once ready), and are stopped at the end of their README section, after the
  section's other commands ran against them;
- fixed ports (8000, 8786) become free ports and `SCHEDULER_HOST` is 127.0.0.1; `uvicorn` gets
  its port from `UVICORN_PORT`, so its command stays as written;
- as root (CI), `jupyter notebook` is allowed to run as root by the test's Jupyter config;
- the names the README leaves to the user exist: `my_agents.py` (class `MyAgent`) in the
  working folder, importable by the Dask worker, and `path/to/my_env` (a copy of the test env);
- `python -m pytest` collects the suite (`--collect-only`: running it is .ci/run's job), and
  the benchmarks play 2 short episodes (`--episodes 2 --max-iter 10`): a check that they run,
  not a measure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

MY_AGENTS = '''\
from grid2op.Agent import DoNothingAgent


class MyAgent(DoNothingAgent):
    """The agent the README's commands name."""
'''


@dataclass
class Command:
    section: str
    text: str  # as the README shows it


def readme_commands(text: str) -> tuple[list[Command], list[str]]:
    """Shell commands of the ```bash blocks (and `$ ` lines of plain blocks), with the
    alternatives given in comments (`# or: ...`); and the complete Python programs."""
    commands: list[Command] = []
    programs: list[str] = []
    section = ""
    for block in re.split(r"^(```[a-z]*\n.*?^```)", text, flags=re.S | re.M):
        if not block.startswith("```"):
            headings = re.findall(r"^## (.*)$", block, flags=re.M)
            section = headings[-1] if headings else section
            continue
        kind, body = block.split("\n", 1)[0][3:], block.split("\n", 1)[1].rsplit("```", 1)[0]
        if kind == "python":
            if 'if __name__ == "__main__":' in body and "POLICY_URL" not in body:
                programs.append(body)  # the HttpAgent program needs a service: test_examples.py
            continue
        for line in body.splitlines():
            line = line.strip()
            if kind == "":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif kind != "bash" or not line:
                continue
            command, _, comment = (" " + line).partition(" #")
            if command.strip():
                commands.append(Command(section, command.strip()))
            alternative = re.match(r"\s*or:\s*(.*?)\s*(\(|$)", comment)
            if alternative:
                commands.append(Command(section, alternative[1]))
    return commands, programs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_ok(url: str, timeout: float = 2) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _served_within(url: str, seconds: float) -> bool:
    """``url`` answers 200 within ``seconds`` (a loaded CI machine may take more than one try:
    Jupyter's first contents request once took over 2 s there)."""
    deadline = time.monotonic() + seconds
    while not _http_ok(url, timeout=10):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@dataclass
class Shell:
    """The fresh venv, and the servers started by the current README section."""

    cwd: Path
    env: dict[str, str]
    log: Path
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def run(
        self, command: str, timeout: float, env: dict[str, str] | None = None, quiet: bool = False
    ) -> str:
        """``command``'s output, once it succeeded; ``quiet``: and printed no traceback (a
        program ending with an "Exception ignored" one from a ``__del__`` counts)."""
        start = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.cwd,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self.timings.append((command, time.monotonic() - start))
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert not quiet or "Traceback" not in done.stderr, f"{command}\n{done.stderr[-3000:]}"
        return done.stdout

    def start(
        self, command: str, ready: Callable[[str], bool], env: dict[str, str] | None = None
    ) -> str:
        """Starts ``command``; returns its output once ``ready`` says it serves."""
        start = time.monotonic()
        out = self.log.with_name(f"server-{len(self.servers)}-{len(self.timings)}.log")
        with out.open("wb") as f:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=self.cwd,
                env=env or self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers.append(process)
        deadline = time.monotonic() + 240
        while not ready(out.read_text(errors="replace")):
            assert process.poll() is None, f"{command} exited:\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{command} did not start:\n{out.read_text()}"
            time.sleep(0.5)
        self.timings.append((command + "   (started, serving)", time.monotonic() - start))
        return out.read_text(errors="replace")

    def stop_servers(self) -> None:
        for process in reversed(self.servers):
            if process.poll() is None:
                os.killpg(
                    process.pid, signal.SIGTERM
                )  # its own session: the server and its workers
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:  # pragma: no cover
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        self.servers.clear()


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".git", "__pycache__", "*.egg-info", "runs", ".*_cache", "build", "dist", ".coverage*"
        ),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(venv),
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
        BROWSER="true",  # `jupyter notebook` opens a browser: here the `true` command
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    if os.geteuid() == 0:  # CI runs as root, where `jupyter notebook` asks for --allow-root
        config = tmp_path / "jupyter-config"
        config.mkdir()
        (config / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}')
    # What the README leaves to the user: their agent module and their env folder.
    (repo / "my_agents.py").write_text(MY_AGENTS)
    import grid2op

    data = Path(grid2op.__file__).parent / "data" / "l2rpn_case14_sandbox"
    shutil.copytree(data, repo / "path" / "to" / "my_env")
    s = Shell(repo, env, tmp_path / "commands.log")
    try:
        yield s
    finally:
        s.stop_servers()


def _plan(command: Command, shell: Shell, ports: dict[str, int]) -> None:
    text = command.text.replace("8000", str(ports["web"])).replace("8786", str(ports["dask"]))
    text = text.replace("SCHEDULER_HOST", "127.0.0.1")
    if text.endswith("python -m pytest"):  # after `pip install ... &&`
        out = shell.run(text + " --collect-only -q -n0", timeout=1500)
        assert re.search(r"\d+ tests collected", out), out[-2000:]
    elif text.startswith("pip install"):
        shell.run(text, timeout=1500)
    elif text.startswith(("asyncrunner bench", "python examples/bench_central.py")):
        shell.run(text + " --episodes 2 --max-iter 10", timeout=600)
    elif text.startswith("python examples/web_app.py"):
        health = f"http://127.0.0.1:{ports['web']}/health"
        shell.start(text, lambda _: _http_ok(health))
    elif text.startswith("uvicorn"):
        port = _free_port()
        env = {**shell.env, "UVICORN_PORT": str(port)}
        shell.start(text, lambda _: _http_ok(f"http://127.0.0.1:{port}/health"), env=env)
    elif text.startswith("jupyter notebook"):
        served = r"(http://(?:localhost|127\.0\.0\.1):\d+)/\S*token=(\w+)"
        log = shell.start(text, lambda out: re.search(served, out) is not None)
        url, token = re.findall(served, log)[0]
        root = re.findall(r"Serving notebooks from local directory: (\S+)", log)[0]
        path = os.path.relpath(shell.cwd / "examples" / "notebook.ipynb", root)
        notebook = f"{url}/api/contents/{path}?token={token}"
        assert _served_within(notebook, 120), log  # the server serves the example notebook
    elif text.startswith("dask scheduler"):
        shell.start(text, lambda out: "Scheduler at:" in out)
    elif text.startswith("dask worker"):
        env = {**shell.env, "PYTHONPATH": str(shell.cwd)}  # the agent's module, "installed"
        shell.start(text, lambda out: "Registered to:" in out, env=env)
    elif text.startswith("curl -N"):
        out = shell.run(text, timeout=600)
        assert "event: end" in out, out[-2000:]
    elif text.startswith("jupyter nbconvert"):
        shell.run(text, timeout=900)
        assert (shell.cwd / "examples" / "notebook.nbconvert.ipynb").is_file()
    else:
        shell.run(text, timeout=900)
        if text.startswith("asyncrunner show") and "--plot" in text:
            assert (shell.cwd / text.split("--plot ")[1].split()[0]).stat().st_size > 10_000


@pytest.mark.timeout(3600)
def test_every_readme_command_runs_as_written(shell: Shell) -> None:
    commands, programs = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) > 20 and any("jupyter nbconvert" in c.text for c in commands)
    ports = {"web": _free_port(), "dask": _free_port()}
    start = time.monotonic()
    section = None
    for command in commands:
        if command.section != section:
            shell.stop_servers()
            section = command.section
        _plan(command, shell, ports)
    shell.stop_servers()
    assert programs
    for i, program in enumerate(programs):
        (shell.cwd / f"readme_program_{i}.py").write_text(program)
        shell.run(f"python readme_program_{i}.py", timeout=600, quiet=True)
    report = "\n".join(f"{seconds:7.1f} s  {command}" for command, seconds in shell.timings)
    print(f"\n{report}\n{time.monotonic() - start:7.1f} s  in all")
