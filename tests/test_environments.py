"""Environments (mcore_rl/environments/): the tool-call parser, the calculator, the Python
sandbox (its limits, and the escapes its default isolation blocks: each tried under the default
and, as a control that the attempt works, under env.sandbox=unsafe_subprocess), the executor's
deadlines and recovery, the one-turn environment against the verifier, the tool-use environment,
and the env.* keys at load time.

Heavy imports (the config loader, the verifiers: torch) stay inside the tests: the executor's
spawned workers import this module to unpickle its environments."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from mcore_rl.data.example import Example
from mcore_rl.environments.base import (ENV_ERROR, ENV_ERRORS, TOOL_CALLS, TOOL_ERRORS,
                                        TOOL_TIMEOUTS, TURNS, EpisodeState, StepResult)
from mcore_rl.environments.executor import EnvironmentExecutor, failed
from mcore_rl.environments.sandbox import (BWRAP, UNSAFE_SUBPROCESS, PythonSandbox,
                                           isolation_problem, run_python, unsafe_warning)
from mcore_rl.environments.tools import (Calculator, CalculatorError, ToolCall,
                                         evaluate_arithmetic, parse_tool_calls,
                                         render_tool_response)

# A stalled step waits forever; this bound (seconds) only tells one from a slow step on a loaded
# machine (the 2-core CI machine has run these at a load average over 100: 47 s for a 2 s deadline).
STALL = 300

EXAMPLES = [Example(f"{a}+{b}=", str(a + b), str(a + b), f"synthetic:test:{i}")
            for i, (a, b) in enumerate([(23, 45), (7, 8), (0, 0), (99, 1)])]


def _call(expression):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}' \
           f'\n</tool_call>'


# ---------------------------------------------------------------------------- tool-call parser

def test_parser_reads_well_formed_calls():
    text = ('Let me compute. ' + _call("23*45") + ' and <tool_call>{"name": "python", '
            '"arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> <tool_call>{"name": "x"}'
            '</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "23*45"}),
                                      ToolCall("python", {"code": "print(1)"}),
                                      ToolCall("x", {})]
    assert parse_tool_calls("1035") == []
    assert render_tool_response('{"result": 1}') == '<tool_response>\n{"result": 1}\n</tool_response>'


@pytest.mark.parametrize("body, error", [
    ("{not json", "not valid JSON"),
    ('["calculator"]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": "{oops"}', "arguments are not valid JSON"),
    ("[" * 100_000, "not valid JSON"),  # deep nesting: RecursionError inside json
])
def test_parser_turns_malformed_calls_into_errors(body, error):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and error in call.error


def test_parser_reports_an_unclosed_tag():
    calls = parse_tool_calls(_call("1+1") + ' <tool_call>{"name": "calculator", "argu')
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert len(calls) == 2 and "unclosed" in calls[1].error


# ---------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, value", [
    ("23*45", 1035), ("2 + 3 * (4 - 1)", 11), ("7 // 2", 3), ("-7 % 3", 2), ("2 ** 10", 1024),
    ("1 / 4", 0.25), ("2 ** -2", 0.25), ("-(+3)", -3), ("1.5e3 + 1", 1501.0), ("2**4000 // 2**3999", 2),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value
    result = Calculator()({"expression": expression})
    assert not result.error and json.loads(result.content) == {"result": value}


@pytest.mark.parametrize("expression, why", [
    ("2**10**10", "power larger"), ("9**9**9**9", "power larger"), ("(10**1000)**1000", "larger"),
    ("2**4097", "larger than 4096 bits"), ("10**400.0", "cannot evaluate"),
    ("1e308 * 10", "not finite"), ("(-8) ** 0.5", "not a real number"), ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"), ("x + 1", "Name"), ("__import__('os').system('true')", "Call"),
    ("(1).__class__", "Attribute"), ("'a' * 10", "Constant"), ("[1] * 10**9", "List"),
    ("1 < 2", "Compare"), ("lambda: 1", "Lambda"), ("True + 1", "Constant"), ("1j * 1j", "Constant"),
    ("9" * 2000, "longer than"), ("(" * 500 + "1" + ")" * 499, "not an arithmetic expression"),
    ("", "not an arithmetic expression"),
])
def test_calculator_refuses_hostile_input_at_once(expression, why):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=why):
        evaluate_arithmetic(expression)
    result = Calculator()({"expression": expression})
    assert result.error and why in json.loads(result.content)["error"]
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("signs, value", [(300, 1), (301, -1)])
def test_calculator_evaluates_deep_nesting_within_the_recursion_limit(signs, value):
    # one frame of the evaluator a level: 301 levels stay well inside the default limit of 1000
    result = Calculator()({"expression": "-" * signs + "7"})
    assert not result.error and json.loads(result.content) == {"result": 7 * value}


def test_calculator_refuses_nesting_past_the_recursion_limit():
    result = Calculator()({"expression": "-" * 999 + "1"})  # RecursionError: an error, no raise
    assert result.error and "recursion" in json.loads(result.content)["error"].lower()


def test_calculator_needs_an_expression_string():
    for arguments in ({}, {"expression": 12}, {"expr": "1+1"}):
        result = Calculator()(arguments)
        assert result.error and "expression" in json.loads(result.content)["error"]


# ---------------------------------------------------------------------------- sandbox

def test_sandbox_runs_a_program():
    r = run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == (
        "42\n", "warn\n", 0, False, False)


def test_sandbox_program_that_raises():
    r = run_python("def f():\n    raise ValueError('boom')\nf()\n")
    assert r.exit_code == 1 and not r.timed_out
    assert "ValueError: boom" in r.stderr and "main.py" in r.stderr and "<string>" not in r.stderr


def test_sandbox_kills_a_program_at_the_wall_clock_limit():
    r = run_python("import time\nprint('start', flush=True)\nwhile True:\n    time.sleep(0.1)\n",
                   timeout_seconds=1.0)
    assert r.timed_out and r.exit_code == -9 and r.stdout == "start\n"
    assert 1.0 <= r.seconds < 10
    result = PythonSandbox(timeout_seconds=1.0)({"code": "while True: pass"})
    assert result.timed_out and not result.error and json.loads(result.content)["timed_out"]


def test_sandbox_cpu_limit_stops_a_busy_loop():
    r = run_python("while True: pass", timeout_seconds=60, cpu_seconds=1)
    assert r.timed_out and r.exit_code < 0 and r.seconds < 30


def test_sandbox_truncates_megabytes_of_output():
    r = run_python("import sys\nfor _ in range(200): print('x' * 10_000)\n"
                   "sys.stderr.write('e' * 3_000_000)\n", max_output_chars=1000)
    assert r.exit_code == 0 and r.truncated
    assert r.stdout == "x" * 1000 and r.stderr == "e" * 1000
    assert len(json.loads(PythonSandbox(max_output_chars=50)({"code": "print('y' * 10**6)"})
                          .content)["stdout"]) == 50


def test_sandbox_memory_limit_fails_a_large_allocation():
    r = run_python("data = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert r.exit_code == 1 and not r.timed_out and "MemoryError" in r.stderr
    assert "allocated" not in r.stdout


def test_sandbox_gets_no_environment_and_no_packages(monkeypatch):
    monkeypatch.setenv("MCORE_RL_SECRET", "hunter2")
    r = run_python("import os, sys\nprint(os.environ.get('MCORE_RL_SECRET'))\n"
                   "print(sys.flags.isolated, sys.flags.no_site)\nimport pytest\n")
    assert r.stdout == "None\n1 1\n" and "ModuleNotFoundError" in r.stderr
    result = PythonSandbox()({"code": "raise SystemExit(3)"})
    assert result.error and json.loads(result.content)["exit_code"] == 3
    assert PythonSandbox()({"program": "print(1)"}).error


def test_sandbox_reports_a_signal_and_bounds_its_tmp():
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert r.exit_code == -signal.SIGTERM and not r.timed_out
    # /tmp is the one writable place, and it is bounded: 5 files of 15 MiB pass 64 MiB.
    r = run_python("import os\nopen('notes.txt', 'w').write('kept')\n"
                   "print(open('/tmp/notes.txt').read())\n"
                   "for i in range(5):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (15 << 20))\n")
    assert r.stdout == "kept\n" and r.exit_code == 1 and "No space left on device" in r.stderr
    for path in ("/x", "/dev/x", "/sandbox/python/x"):
        r = run_python(f"open({path!r}, 'w')")
        assert r.exit_code == 1 and "Read-only file system" in r.stderr, path


def test_unsafe_subprocess_runs_the_program_and_leaves_no_directory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_python("import os\nprint(os.path.basename(os.getcwd())[:17], os.getuid() == "
                   f"{os.getuid()})", isolation=UNSAFE_SUBPROCESS)
    assert r.stdout == "mcore_rl_sandbox_ True\n" and r.exit_code == 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="env.sandbox must be one of bwrap, unsafe_subprocess"):
        run_python("print(1)", isolation="docker")


@pytest.fixture
def fresh_view():
    """interpreter_view() built again in the test and after it (it caches per process)."""
    from mcore_rl.environments import isolation

    isolation.interpreter_view.cache_clear()
    yield isolation
    isolation.interpreter_view.cache_clear()


def test_sandbox_stages_the_interpreter_once_or_binds_each_file(fresh_view, tmp_path,
                                                                monkeypatch):
    isolation = fresh_view
    code = "import hashlib, sqlite3\nprint(hashlib.sha256(b'').hexdigest()[:8])"
    # A staged prefix in the user's cache: one directory bound for the interpreter and libraries.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    view = isolation.interpreter_view()
    staged, inner = view.binds[0]
    assert inner == isolation.PYTHON_PREFIX and staged.startswith(str(tmp_path))
    assert os.path.isfile(os.path.join(staged, "bin", "python3")) and len(view.binds) <= 4
    assert run_python(code).stdout == "e3b0c442\n"
    isolation.interpreter_view.cache_clear()
    assert isolation.interpreter_view() == view  # the same directory, not made twice
    assert len(os.listdir(tmp_path / "mcore_rl" / "sandbox")) == 1
    # No cache directory to be had: one bind per file, the same program's output.
    isolation.interpreter_view.cache_clear()

    def no_cache():
        raise OSError("read-only home")

    monkeypatch.setattr(isolation, "_cache_root", no_cache)
    view = isolation.interpreter_view()
    inners = [inner for _, inner in view.binds]
    assert isolation.PYTHON in inners and sum(i.startswith(isolation.LIB_DIR) for i in inners) > 1
    assert run_python(code).stdout == "e3b0c442\n"


# ---------------------------------------------------------------------------- sandbox escapes
# Each tries one escape of issue 40 under the default isolation (run_python without isolation=,
# which must block it) and, as a control that the attempt itself works, under
# env.sandbox=unsafe_subprocess (which does not). Before issue 40 the default was the plain
# subprocess: each default case failed.

ISOLATIONS = [pytest.param(None, id="default"), pytest.param(UNSAFE_SUBPROCESS, id="unsafe")]


def _run(code, isolation, **kw):
    """``run_python(code)`` with the default isolation (None) or the one named."""
    return run_python(code, **kw) if isolation is None else \
        run_python(code, isolation=isolation, **kw)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_read_a_host_file(isolation, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    paths = ["/etc/hostname", str(secret)]
    r = _run("for p in %r:\n    try:\n        print(open(p).read())\n"
             "    except OSError as e:\n        print(type(e).__name__)\n" % (paths,), isolation)
    if isolation is None:
        assert r.stdout == "FileNotFoundError\nFileNotFoundError\n", r
    else:
        assert "hunter2" in r.stdout


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_list_the_home_directory(isolation):
    home = os.path.expanduser("~")
    assert os.listdir(home)  # something to see
    r = _run(f"import os\nprint(sorted(os.listdir({home!r})))", isolation)
    if isolation is None:
        assert r.exit_code == 1 and "FileNotFoundError" in r.stderr and r.stdout == "", r
    else:
        assert r.stdout == f"{sorted(os.listdir(home))}\n"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_write_outside_the_sandbox_tmp(isolation, tmp_path):
    target = tmp_path / "planted.py"
    r = _run(f"open({str(target)!r}, 'w').write('reward = 1.0')", isolation)
    if isolation is None:
        assert r.exit_code == 1 and "FileNotFoundError" in r.stderr, r
        assert not target.exists()
    else:
        assert target.read_text() == "reward = 1.0"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_connect_to_a_loopback_server(isolation):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        r = _run("import socket\ntry:\n"
                 f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                 "    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)\n",
                 isolation)
        try:
            conn, _ = server.accept()
            conn.close()
            accepted = True
        except BlockingIOError:
            accepted = False
    finally:
        server.close()
    if isolation is None:
        assert r.stdout == "ConnectionRefusedError\n" and not accepted, r  # its own loopback
    else:
        assert r.stdout == "connected\n" and accepted


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_fork_past_the_limit(isolation):
    r = _run("import os\nforked = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
             "    except OSError as e:\n        print(type(e).__name__)\n        break\n"
             "    if pid == 0:\n        os._exit(0)\n    forked += 1\n"
             "for _ in range(forked):\n    os.wait()\nprint(forked)\n"
             "import threading\ntry:\n    threading.Thread(target=print).start()\n"
             "except RuntimeError as e:\n    print(e)\n", isolation, timeout_seconds=60)
    if isolation is None:  # no new process nor thread, whoever runs the trainer
        assert r.stdout == "BlockingIOError\n0\ncan't start new thread\n", r
    elif os.geteuid() == 0:  # RLIMIT_NPROC does not bind root
        assert r.stdout.startswith("200\n")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_read_the_runs_data_files(isolation, tmp_path):
    """The reward-hacking case: the data set's answers and the verifier's source."""
    import mcore_rl.rewards.exact as verifier
    from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR

    answers = tmp_path / "runs" / "grpo_arith_tools" / "answers.jsonl"
    answers.parent.mkdir(parents=True)
    answers.write_text('{"prompt": "23*45=", "answer": "1035"}\n')
    paths = [str(answers), str(GSM8K_SAMPLE_DIR / "test.jsonl"), verifier.__file__]
    r = _run("for p in %r:\n    try:\n        print(len(open(p).read()) > 0)\n"
             "    except OSError as e:\n        print(type(e).__name__)\n" % (paths,), isolation)
    if isolation is None:
        assert r.stdout == "FileNotFoundError\n" * 3, r
    else:
        assert r.stdout == "True\n" * 3


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_escape_signal_a_process_outside(isolation):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        r = _run(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\nprint('sent')",
                 isolation)
        if isolation is None:
            assert r.exit_code == 1 and "ProcessLookupError" in r.stderr, r
            assert victim.poll() is None
        else:
            assert r.stdout == "sent\n" and victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait()


def test_default_config_isolates():
    from mcore_rl.config.schema import TrainConfig

    assert TrainConfig().env.sandbox == BWRAP and PythonSandbox().isolation == BWRAP
    assert isolation_problem() is None  # bwrap runs on this machine kind (make setup installs it)
    assert unsafe_warning(_tool_env(tools=(Calculator(), PythonSandbox()))) is None
    warning = unsafe_warning(_tool_env(tools=(PythonSandbox(isolation=UNSAFE_SUBPROCESS),)))
    assert "env.sandbox=unsafe_subprocess" in warning and "without isolation" in warning


# ---------------------------------------------------------------------------- executor

@dataclass(frozen=True)
class ScriptedEnv:
    """Test environment: a step's text says what it does ("raise", "sleep", "crash", "exit",
    "none", or anything else: reward len(text), done)."""

    def reset(self, example):
        if example.prompt == "raise":
            raise RuntimeError("reset failed")
        return f"obs:{example.prompt}", {TURNS: 0}

    def step(self, state, text):
        if text == "raise":
            raise ValueError("step failed")
        if text == "sleep":
            time.sleep(600)
        if text == "crash":
            os._exit(7)
        if text == "exit":
            sys.exit(3)
        if text == "none":
            return None
        return StepResult(None, float(len(text)), True, {**state.metadata, TURNS: state.turn + 1})


def _states(n):
    return [EpisodeState(Example(f"p{i}", "0", "0", f"test:{i}"), {TURNS: 0}) for i in range(n)]


def test_executor_in_process_catches_errors():
    executor = EnvironmentExecutor(ScriptedEnv(), num_workers=0)
    out = executor.step(_states(2), ["ok", "raise"])
    assert out[0] == StepResult(None, 2.0, True, {TURNS: 1})
    assert out[1].reward == 0.0 and out[1].done and "step failed" in out[1].observation
    assert out[1].metadata[ENV_ERRORS] == 1 and "ValueError" in out[1].metadata[ENV_ERROR]
    exited, nothing = executor.step(_states(2), ["exit", "none"])
    assert "SystemExit(3)" in exited.metadata[ENV_ERROR] and exited.reward == 0 and exited.done
    assert "not a StepResult" in nothing.metadata[ENV_ERROR]
    resets = executor.reset([Example("raise", "0", "0", "t:0"), Example("q", "0", "0", "t:1")])
    assert failed(resets[0][1]) and resets[1] == ("obs:q", {TURNS: 0})
    with pytest.raises(ValueError, match="2 episodes, 1 model turns"):
        executor.step(_states(2), ["ok"])


def test_executor_survives_raising_hanging_and_dying_steps():
    with EnvironmentExecutor(ScriptedEnv(), num_workers=2, timeout_seconds=2.0) as executor:
        executor.warm_up()
        start = time.monotonic()
        out = executor.step(_states(5), ["a", "raise", "sleep", "bbb", "cc"])
        assert time.monotonic() - start < STALL
        assert [r.reward for r in out] == [1.0, 0.0, 0.0, 3.0, 2.0]
        assert [r.done for r in out] == [True] * 5
        assert "step failed" in out[1].metadata[ENV_ERROR]
        assert "env.step_timeout_seconds=2" in out[2].metadata[ENV_ERROR]
        assert [ENV_ERROR in r.metadata for r in out] == [False, True, True, False, False]
        assert executor.pools_made == 2  # the hung worker's pool was replaced
        # A worker that dies: the step fails after its second try, the executor goes on.
        (dead,) = executor.step(_states(1), ["crash"])
        assert dead.reward == 0.0 and "worker process died (2 tries)" in dead.metadata[ENV_ERROR]
        out = executor.step(_states(3), ["dddd", "e", "ff"])
        assert [r.reward for r in out] == [4.0, 1.0, 2.0]
        assert executor.reset([Example("q", "0", "0", "t:0")]) == [("obs:q", {TURNS: 0})]


# ---------------------------------------------------------------------------- environments

def test_single_turn_equals_the_verifier():
    from mcore_rl.config.schema import TrainConfig
    from mcore_rl.environments import build_environment
    from mcore_rl.rewards import get_reward_fn

    responses = ["68", " 15\n1+2=", "0", "99", "", "068", "68 1", "+100"]
    cases = [(r, e) for r in responses for e in EXAMPLES]
    gsm = Example("How many?", "1,000", "", "gsm8k:test:0")
    for name, extra in (("exact", []), ("math", [(r, gsm) for r in (
            "#### 1000", "The answer is \\boxed{1000}", "#### 999", "about 1000 then 12")])):
        cfg = TrainConfig()
        cfg.reward.name = name
        env = build_environment(cfg)
        verifier = get_reward_fn(name)
        executor = EnvironmentExecutor(env, num_workers=0)
        for response, example in cases + extra:
            observation, metadata = env.reset(example)
            assert observation is None
            state = EpisodeState(example, metadata)
            result = env.step(state, response)
            assert result.reward == verifier(response, example) and result.done
            assert result.observation is None and result.metadata[TURNS] == 1
            assert executor.step([state], [response]) == [result]
    assert sum(build_environment(TrainConfig()).step(EpisodeState(e, {}), e.answer).reward
               for e in EXAMPLES) == len(EXAMPLES)


def _tool_env(**kw):
    from mcore_rl.environments.tool_use import ToolUseEnvironment
    from mcore_rl.rewards.exact import exact_reward

    return ToolUseEnvironment(exact_reward, **kw)


def _episode(env, example, turns):
    observation, metadata = env.reset(example)
    assert observation is None
    state, results = EpisodeState(example, metadata), []
    for text in turns:
        results.append(env.step(state, text))
        if results[-1].done:
            break
        state = state.advance(results[-1])
    return results


def test_tool_use_calculator_then_answer():
    from mcore_rl.environments.tools import tool_schemas

    env = _tool_env()
    first, last = _episode(env, EXAMPLES[0], [f"I will use the calculator. {_call('23+45')}",
                                              "68"])
    assert not first.done and first.reward == 0
    assert first.observation == render_tool_response('{"result": 68}')
    assert last.done and last.reward == 1.0 and last.observation is None
    assert {k: last.metadata[k] for k in (TURNS, TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS)} == {
        TURNS: 2, TOOL_CALLS: 1, TOOL_ERRORS: 0, TOOL_TIMEOUTS: 0}
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator"]
    assert tool_schemas(env.tools) == env.tool_schemas()
    with pytest.raises(ValueError, match="ended at turn 2"):
        EpisodeState(EXAMPLES[0], {}, 1).advance(last)
    # A wrong answer without any tool: one turn, reward 0.
    (only,) = _episode(env, EXAMPLES[0], ["67"])
    assert only.done and only.reward == 0 and only.metadata[TURNS] == 1


def test_tool_use_errors_are_observations_and_counted():
    env = _tool_env()
    results = _episode(env, EXAMPLES[1], [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "7+"}}</tool_call>',
        "<tool_call>{oops</tool_call>" + _call("7+8"),
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
        "15"])
    assert len(results) == 4 and results[-1].reward == 1.0
    assert '"error"' in results[0].observation and "not valid JSON" in results[1].observation
    assert '{"result": 15}' in results[1].observation and "unknown tool 'search'" in \
        results[2].observation
    m = results[-1].metadata
    assert (m[TURNS], m[TOOL_CALLS], m[TOOL_ERRORS], m[TOOL_TIMEOUTS]) == (4, 4, 3, 0)


def test_tool_use_ends_at_max_turns_and_counts_sandbox_timeouts():
    env = _tool_env(tools=(Calculator(), PythonSandbox(timeout_seconds=1.0)), max_turns=3)
    code = json.dumps({"name": "python", "arguments": {"code": "import time; time.sleep(30)"}})
    results = _episode(env, EXAMPLES[2], [f"<tool_call>{code}</tool_call>", _call("0+0"),
                                          _call("0*0"), "0"])
    assert len(results) == 3
    assert '"timed_out": true' in results[0].observation
    last = results[-1]
    assert last.done and last.reward == 0.0 and last.metadata["truncated"]
    assert (last.metadata[TURNS], last.metadata[TOOL_CALLS], last.metadata[TOOL_TIMEOUTS]) == (
        3, 3, 1)


def test_tool_use_from_config_and_pickles():
    from mcore_rl.config.loader import load_config
    from mcore_rl.environments import build_environment

    cfg = load_config("grpo_synthetic", ["env.name=tool_use", "env.max_turns=2",
                                         "env.tool_timeout_seconds=3", "env.max_output_chars=10"])
    env = build_environment(cfg)
    assert env.max_turns == 2 and [t.name for t in env.tools] == ["calculator", "python"]
    assert env.tools[1] == PythonSandbox(timeout_seconds=3.0, cpu_seconds=5, memory_mb=512,
                                         max_output_chars=10)
    assert pickle.loads(pickle.dumps(env)) == env


def test_grpo_arith_tools_episodes_give_the_same_rewards_isolated():
    """The calculator and Python tool episodes of grpo_arith_tools: the same observations and
    rewards under bwrap (the default) as under the plain subprocess of before issue 40."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.environments import build_environment

    def python(code):
        return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + \
            "</tool_call>"

    example = Example("23*45=", "1035", "1035", "synthetic:test:0")
    episodes = [
        [_call("23*45"), "1035"],                                          # calculator, right
        [_call("23*45"), "1036"],                                          # calculator, wrong
        [python("print(23*45)"), "1035"],                                  # python, right
        [python("import math\nprint(math.prod([23, 45]), 2**100 % 97)"), "1035"],
        [python("print(open('/etc/hostname').read())") + _call("20*45+3*45"), "1035"],
        [python("while True: pass"), "1035"],                              # past its limit
        ["1035"], ["999"],                                                 # no tool
    ]
    rewards, observations = {}, {}
    for sandbox in (BWRAP, UNSAFE_SUBPROCESS):
        cfg = load_config("grpo_arith_tools", [f"env.sandbox={sandbox}",
                                               "env.tool_timeout_seconds=2"])
        env = build_environment(cfg)
        assert env.tools[1].isolation == sandbox
        runs = [_episode(env, example, turns) for turns in episodes]
        rewards[sandbox] = [sum(r.reward for r in run) for run in runs]
        observations[sandbox] = [[r.observation for r in run] for run in runs]
    assert rewards[BWRAP] == rewards[UNSAFE_SUBPROCESS] == [1, 0, 1, 1, 1, 1, 1, 0]
    same = [0, 1, 2, 3, 5, 6, 7]  # episode 4 reads a host file: only the sandbox differs
    assert [observations[BWRAP][i] for i in same] == [observations[UNSAFE_SUBPROCESS][i]
                                                       for i in same]
    assert '"stdout": "1035 16\\n"' in observations[BWRAP][3][0]
    assert "FileNotFoundError" in observations[BWRAP][4][0] and '{"result": 1035}' in \
        observations[BWRAP][4][0]


# ---------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, message", [
    (["env.name=gym"], "env.name must be one of single_turn, tool_use, or a "
                      "\"module:attribute\" import path (got 'gym')"),
    (["env.max_turns=0"], "env.max_turns must be in [1, 1024] (got 0)"),
    (["env.tool_timeout_seconds=0"], "env.tool_timeout_seconds must be > 0 (got 0.0)"),
    (["env.max_output_chars=0"], "env.max_output_chars must be >= 1 (got 0)"),
    (["env.sandbox_memory_mb=16"], "env.sandbox_memory_mb must be >= 64 (got 16)"),
    (["env.sandbox_cpu_seconds=0"], "env.sandbox_cpu_seconds must be in [1, 3600] (got 0)"),
    (["env.sandbox=docker"], "env.sandbox must be one of bwrap, unsafe_subprocess (got 'docker')"),
    (["env.num_workers=-1"], "env.num_workers must be in [0, 256] (got -1)"),
    (["env.step_timeout_seconds=-1"], "env.step_timeout_seconds must be > 0 (got -1.0)"),
    (["env.step_timeout_seconds=5"], "env.step_timeout_seconds (5.0) must be > "
                                     "env.tool_timeout_seconds (10.0)"),
])
def test_bad_env_values_fail_at_load_time_naming_the_key(overrides, message):
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.config.loader import load_config

    with pytest.raises(ConfigError) as info:
        load_config("grpo_synthetic", overrides)
    assert str(info.value).startswith("invalid config: ") and message in str(info.value)


def test_env_defaults_are_the_one_turn_verifier():
    from mcore_rl.config.schema import TrainConfig

    env = TrainConfig().env
    assert env.name == "single_turn" and env.max_turns == 4


@pytest.fixture
def no_isolation_cache():
    """isolation_problem() probes again in the test and after it (it caches per process)."""
    isolation_problem.cache_clear()
    yield
    isolation_problem.cache_clear()


def _fake_bwrap(tmp_path, monkeypatch, script):
    """``script`` stands in for bwrap, first on PATH; None: no bwrap on PATH at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    rest = os.environ["PATH"].split(os.pathsep)
    if script is None:
        rest = [d for d in rest if not os.path.exists(os.path.join(d, "bwrap"))]
    else:
        (bin_dir / "bwrap").write_text("#!/bin/sh\n" + script)
        (bin_dir / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), *rest]))


@pytest.mark.parametrize("script, why", [
    (None, "bubblewrap (bwrap) is not installed"),
    ("echo 'bwrap: No permissions to creating new namespace, likely because the kernel does "
     "not allow non-privileged user namespaces.' >&2\nexit 1\n",
     "kernel does not allow non-privileged user namespaces"),
])
def test_sandbox_that_cannot_isolate_is_refused_at_load_in_one_line(
        script, why, tmp_path, monkeypatch, capsys, no_isolation_cache):
    from mcore_rl.cli import main
    from mcore_rl.config.checks import ConfigError
    from mcore_rl.config.loader import load_config

    _fake_bwrap(tmp_path, monkeypatch, script)
    with pytest.raises(ConfigError) as info:
        load_config("grpo_arith_tools")
    (line,) = [m for m in str(info.value).splitlines() if "env.sandbox" in m]
    assert why in line and "env.sandbox=bwrap" in line and "env.sandbox=unsafe_subprocess" in line
    # The explicit choice loads; so does an environment that runs no code.
    assert load_config("grpo_arith_tools", ["env.sandbox=unsafe_subprocess"]).env.sandbox == \
        UNSAFE_SUBPROCESS
    assert load_config("grpo_synthetic").env.sandbox == BWRAP
    # A sandbox call that cannot isolate is an error result, never an unisolated run.
    r = run_python("print(1)")
    assert r.stdout == "" and r.exit_code == (None if script is None else 1) and why in r.stderr
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config-name", "grpo_arith_tools"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
