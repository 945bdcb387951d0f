"""jaxspec.compilation: `CompileWatch` counts compile seconds and announces a compile once,
`set_compile_notices` silences the announcement, and the persistent XLA cache lives where its
environment variables say (and really receives the programs `generate` compiles)."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxspec import checkpoints, compilation

NOTICE = "jaxspec: preparing"


def fresh_program():
    """A jitted function no other test has compiled: its first call must trace and compile."""
    return jax.jit(lambda x: jnp.tanh(x) * 2.0 + 1.0)


@pytest.fixture
def notices_on():
    """Notices on for the test and on again afterwards (the default), whatever the test did."""
    compilation.set_compile_notices(True)
    yield
    compilation.set_compile_notices(True)


def notice_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(NOTICE)]


def test_a_compile_counts_its_seconds_and_a_cache_hit_counts_none(notices_on, capsys):
    program, x = fresh_program(), jnp.arange(4.0)
    capsys.readouterr()
    with compilation.CompileWatch("the fresh program") as first:
        program(x).block_until_ready()
    assert first.seconds > 0.0
    # Tracing, lowering and the XLA compile each report an event; the notice comes once.
    [line] = notice_lines(capsys)
    assert line.startswith(f"{NOTICE} the fresh program ... compiled in ")
    assert line.endswith("s (once per shape in a process)")  # the suite keeps no disk cache

    with compilation.CompileWatch("the fresh program again") as again:
        program(x).block_until_ready()
    assert again.seconds == 0.0  # jit's in-memory cache served it: no compile event at all
    assert notice_lines(capsys) == []

    with compilation.CompileWatch("a new shape") as reshaped:
        program(jnp.arange(5.0)).block_until_ready()
    assert reshaped.seconds > 0.0 and len(notice_lines(capsys)) == 1


def test_silenced_notices_still_count_the_seconds(notices_on, capsys):
    capsys.readouterr()
    compilation.set_compile_notices(False)
    with compilation.CompileWatch("a silenced compile") as watch:
        fresh_program()(jnp.ones(3)).block_until_ready()
    assert watch.seconds > 0.0
    assert notice_lines(capsys) == []
    compilation.set_compile_notices(True)
    with compilation.CompileWatch("an announced compile"):
        fresh_program()(jnp.ones(3)).block_until_ready()
    assert len(notice_lines(capsys)) == 1


def test_an_inner_watch_reports_to_the_outer_one(notices_on, capsys):
    """Compile seconds of a nested watch are the inner's and also count toward the outer's; each
    watch announces its own first compile."""
    capsys.readouterr()
    with compilation.CompileWatch("outer") as outer:
        with compilation.CompileWatch("inner") as inner:
            fresh_program()(jnp.ones(2)).block_until_ready()
        inner_only = outer.seconds
        fresh_program()(jnp.ones(2)).block_until_ready()
    assert inner.seconds > 0.0 and inner_only == inner.seconds
    assert outer.seconds > inner.seconds
    assert [line.split(" ...")[0] for line in notice_lines(capsys)] == [f"{NOTICE} inner", f"{NOTICE} outer"]


def test_a_watch_whose_notice_a_nested_one_interrupts_ends_on_a_line_of_its_own(notices_on, capsys):
    capsys.readouterr()
    with compilation.CompileWatch("outer"):
        fresh_program()(jnp.ones(2)).block_until_ready()
        with compilation.CompileWatch("inner"):
            fresh_program()(jnp.ones(2)).block_until_ready()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" ...")[0].split(": compiled")[0] for line in lines] == [
        f"{NOTICE} outer", f"{NOTICE} inner", "jaxspec: outer"]
    assert all(" compiled in " in line for line in lines[1:])


def test_a_failed_compile_says_so(notices_on, capsys):
    capsys.readouterr()
    with pytest.raises(RuntimeError), compilation.CompileWatch("a doomed program"):
        fresh_program()(jnp.ones(2)).block_until_ready()
        raise RuntimeError("after its first compile")
    assert notice_lines(capsys) == [f"{NOTICE} a doomed program ... failed"]


def test_the_persistent_cache_follows_its_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(compilation.XLA_CACHE_ENV, str(tmp_path / "xla"))
    assert compilation.xla_cache_dir() == tmp_path / "xla"
    monkeypatch.setenv(compilation.XLA_CACHE_ENV, "~/programs")
    assert compilation.xla_cache_dir() == pathlib.Path.home() / "programs"
    for disabled in ("off", "OFF", ""):
        monkeypatch.setenv(compilation.XLA_CACHE_ENV, disabled)
        assert compilation.xla_cache_dir() is None, disabled
    monkeypatch.delenv(compilation.XLA_CACHE_ENV)
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path))
    assert compilation.xla_cache_dir() == tmp_path / "xla"
    monkeypatch.delenv("JAXSPEC_CACHE_DIR")
    assert compilation.xla_cache_dir() == checkpoints.cache_dir() / "xla"


def test_generate_programs_persist_in_the_xla_cache(tmp_path):
    """In a fresh process, after a compile that came first (the random init): the prefill's two
    programs and the decode loop land in $JAXSPEC_XLA_CACHE_DIR (every program: the 1 s floor set to 0),
    and a second process's notices say it loaded them from there."""
    script = (
        "import jax, jaxspec\n"
        "from jaxspec.models import llama\n"
        "from tests.conftest import TINY\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
        "model = jaxspec.Model(config=TINY, params=llama.init_params(TINY, jax.random.PRNGKey(0)))\n"
        "jaxspec.generate(model, None, [1, 2, 3], max_new_tokens=4)\n"
    )
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, compilation.XLA_CACHE_ENV: str(tmp_path / "xla"), "PYTHONPATH": str(repo)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
    written = sorted(path.name.split("-")[0] for path in (tmp_path / "xla").iterdir())
    assert {"jit_prefill_target", "jit_start", "jit_decode"} <= set(written), written  # the prefill's two programs
    notices = [[line for line in proc.stderr.splitlines() if line.startswith("jaxspec: preparing")] for proc in runs]
    assert [len(lines) for lines in notices] == [2, 2], notices  # the prefill and the decode loop, in each
    assert all(" compiled in " in line and "later runs load it from the XLA cache" in line for line in notices[0])
    assert all(" loaded from the XLA cache in " in line for line in notices[1]), notices[1]
