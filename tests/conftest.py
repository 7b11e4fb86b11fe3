"""Every test runs on tinygrad's CPU device, whatever DEV the shell has (a test about another device sets it in the
subprocess it starts): the references, budgets and kernel heuristics here are the CPU's, and a DEV=NULL left in the
environment would otherwise turn the suite into a schedule-only run. TG_DS4_TEST_DEV names another device on purpose:
on a machine with a GPU, `TG_DS4_TEST_DEV=CUDA TG_DS4_PRECISION=f32 pytest tests/test_reference.py ...` holds that
device to the same references (profiles/gpu_check.sh); the CPU-only tests (kernel counts, the CPU replay) fail there."""
import os, pathlib, sys, time

import pytest

os.environ["DEV"] = os.environ.get("TG_DS4_TEST_DEV", "CPU")  # before anything imports tinygrad
# The suite's processes (the pytest-xdist workers, the CLI and server subprocesses, the background jobs) take a kernel
# another one already lowered from the shared program cache (tg_ds4/backend/programs.py), and compile in their own
# process: pytest-xdist's two workers already fill the two cores, so tinygrad's one-process compile pool per worker
# would only add the pool's start-up and a new process every 16 kernels.
os.environ.setdefault("TG_DS4_PROGRAM_CACHE", "1")
os.environ.setdefault("PARALLEL", "0")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

# *** background jobs (background.py): tests marked `background(job)` read the result of a subprocess started when
# collection finishes (under pytest-xdist: when the worker starts the test's module), by `start_job(job)` of the test's
# module. They run last (under pytest-xdist: last in their module), so the rest of the suite overlaps them.

def pytest_configure(config):
  config.addinivalue_line("markers", "background(job): reads the result of its module's background job (start_job(job)); runs last")

# Under pytest-xdist the modules are handed out in collection order (`make test`: --no-loadscope-reorder): the modules
# with background jobs first, so their jobs overlap the whole run instead of trailing it, then the slowest modules
# (fresh-clone durations), so that no long module starts last beside an idle worker.
SLOW_MODULES = ("test_real_models", "test_dsa", "test_ds4", "test_bench", "test_cli", "test_bitnet", "test_batch", "test_speculative",
                "test_mtp_ds4", "test_mtp", "test_reference", "test_checkpoint", "test_gemma4", "test_probe", "test_kernel_opts", "test_server",
                "test_stepcache")

# *** `make test-fast` (pytest --fast): the inner loop, a few minutes on 2 cores. Whole modules of unit tests, and each
# family's float32 reference against transformers on one fixture. `make test` (CI) runs everything.
FAST_MODULES = {"test_batch_compile", "test_chat", "test_compat", "test_emulator", "test_ds4_chat", "test_gguf", "test_gguf_fuzz",
                "test_intdot", "test_kvstore", "test_moe", "test_programs", "test_quant", "test_sampling", "test_serve_limits", "test_tokenizer",
                "test_toolcalls"}
FAST_TESTS = {"test_reference.py::test_f32_matches_transformers[ds3-F32]", "test_ds4.py::test_prefill_matches_transformers",
              "test_dsa.py::test_dsa_matches_transformers[ds32]", "test_gpt2.py::test_gpt2_matches_transformers[F32]",
              "test_qwen3.py::test_qwen3_matches_transformers[F32]", "test_bitnet.py::test_bitnet_matches_transformers[F32]",
              "test_gemma4.py::test_gemma4_matches_transformers[plain-F32]", "test_checkpoint.py::test_logits_and_greedy_match_transformers[llama]"}

def pytest_addoption(parser):
  parser.addoption("--fast", action="store_true", help="the inner loop: unit tests and one float32 reference per family (tests/conftest.py)")

def _fast(item) -> bool:
  return item.module.__name__.rsplit(".", 1)[-1] in FAST_MODULES or item.nodeid.removeprefix("tests/") in FAST_TESTS

def pytest_collection_modifyitems(session, config, items):
  if config.getoption("--fast"):
    config.hook.pytest_deselected(items=[i for i in items if not _fast(i)])
    items[:] = [i for i in items if _fast(i)]
    assert len({i.nodeid.removeprefix("tests/") for i in items} & FAST_TESTS) == len(FAST_TESTS), "a FAST_TESTS entry names no test"
  bg = [i for i in items if i.get_closest_marker("background")]
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    items[:] = [i for i in items if not i.get_closest_marker("background")] + bg
    return
  jobs, name = {i.module.__name__ for i in bg}, lambda i: i.module.__name__.rsplit(".", 1)[-1]
  rank = lambda i: (0 if i.module.__name__ in jobs else 1 + SLOW_MODULES.index(name(i)) if name(i) in SLOW_MODULES else 1 + len(SLOW_MODULES),
                    i.get_closest_marker("background") is not None)
  items.sort(key=rank)  # stable: collection order within each rank

def _start_jobs(items) -> None:
  for item in items:
    if (m := item.get_closest_marker("background")) is not None: item.module.start_job(m.args[0])

def pytest_collection_finish(session):
  # Under pytest-xdist (`make test` runs two workers, one module per worker at a time: --dist loadfile) every worker
  # collects every test but runs only the modules it is sent, so a worker starts a module's jobs when that module starts.
  if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"): return
  _start_jobs(session.items)

@pytest.fixture(autouse=True, scope="module")
def _module_jobs(request):
  if os.environ.get("PYTEST_XDIST_WORKER"): _start_jobs(i for i in request.session.items if i.module is request.module)

def pytest_sessionfinish(session):
  import background
  background.stop_all()

# *** the suite's time: a test over SLOW_TEST_S (setup, call and teardown together; under pytest-xdist the controller
# sees every worker's reports) is named at the end of the run, so the suite's budget (`make test` <= 20 minutes on 2
# cores) is defended one test at a time. A test that reads a shared computation first pays for all its readers.
SLOW_TEST_S, SUITE_BUDGET_S = 60.0, 18 * 60.0
_durations: dict[str, float] = {}
_start = time.monotonic()

def pytest_runtest_logreport(report):
  _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration

def pytest_terminal_summary(terminalreporter):
  slow = sorted(((d, n) for n, d in _durations.items() if d > SLOW_TEST_S), reverse=True)
  if slow:
    terminalreporter.section(f"tests over {SLOW_TEST_S:.0f} s")
    for d, n in slow: terminalreporter.line(f"WARNING slow test: {n} took {d:.0f} s")
  wall = time.monotonic() - _start
  terminalreporter.line(f"suite wall time {wall:.0f} s ({wall / 60:.1f} min; budget {SUITE_BUDGET_S / 60:.0f} min)"
                        + (" -- OVER BUDGET" if wall > SUITE_BUDGET_S else ""))
