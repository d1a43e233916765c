"""The verdicts of make gpu-test, checked on a machine without a GPU (make gpu-verdicts, part of
make test): each check below is fed the output of a run that went right and of one that went
wrong in the way the check exists to catch, and must pass the first and fail the second.

    python3 tests/gpu/verdict_test.py [-v]

Needs bash and Python's standard library only (no PyTorch, no GPU): the GPU scripts' verdict
logic is called as those scripts call it, on made-up results and logs.
"""
import os
import re
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "multi"))

import compare_results  # noqa: E402
import killed_rank  # noqa: E402


def bash(script: str, cwd: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


class Tensor:
    """What compare_results needs of a tensor: compared by value here."""

    def __init__(self, value):
        self.value = value


def same(x, y) -> bool:
    return x.value == y.value


class CompareResults(unittest.TestCase):
    def test_equal_results_are_equal(self):
        a = {"loop": [Tensor(1), Tensor(2)], "graph": [Tensor(3)]}
        b = {"loop": [Tensor(1), Tensor(2)], "graph": [Tensor(3)]}
        self.assertEqual(compare_results.difference(a, b, same), "")

    def test_a_shorter_list_differs(self):
        a = {"loop": [Tensor(1), Tensor(2)]}
        b = {"loop": [Tensor(1)]}
        self.assertEqual(compare_results.difference(a, b, same), "loop: 2 tensors vs 1")
        self.assertEqual(compare_results.difference(b, a, same), "loop: 1 tensors vs 2")

    def test_an_empty_list_is_no_result(self):
        a = {"loop": [Tensor(1)], "graph": []}
        self.assertIn("graph: no tensors", compare_results.difference(a, a, same))

    def test_a_missing_key_differs(self):
        # torch_collectives.py leaves "graph" out when its capture throws: under the shim alone,
        # the result sets then differ.
        a = {"loop": [Tensor(1)], "graph": [Tensor(3)]}
        b = {"loop": [Tensor(1)]}
        self.assertIn("different result sets", compare_results.difference(a, b, same))

    def test_a_different_tensor_differs(self):
        a = {"loop": [Tensor(1), Tensor(2)]}
        b = {"loop": [Tensor(1), Tensor(5)]}
        self.assertEqual(compare_results.difference(a, b, same), "loop[1] differs")


class KilledRank(unittest.TestCase):
    def judge(self, codes, victim=3):
        ended = {r: (code, 10.0 + r) for r, code in codes.items()}
        return killed_rank.judge(ended, 4, victim, 10.0 if victim is not None else None, 120)

    def test_survivors_freed_or_ended_by_the_watchdog_pass(self):
        failed, lines = self.judge({0: 3, 1: -6, 2: 3, 3: -9})
        self.assertFalse(failed, lines)
        self.assertEqual(lines[-1], "every rank ended")

    def test_a_survivor_that_exits_0_fails(self):
        failed, lines = self.judge({0: 3, 1: 0, 2: 3, 3: -9})
        self.assertTrue(failed)
        self.assertIn("rank 1 exited 0", "\n".join(lines))
        self.assertIn("NOT how a survivor ends", "\n".join(lines))

    def test_a_survivor_with_a_traceback_or_a_crash_fails(self):
        self.assertTrue(self.judge({0: 1, 1: 3, 2: 3, 3: -9})[0])
        self.assertTrue(self.judge({0: -11, 1: 3, 2: 3, 3: -9})[0])

    def test_a_hung_survivor_fails(self):
        failed, lines = self.judge({0: 3, 1: 3, 3: -9})
        self.assertTrue(failed)
        self.assertIn("rank 2 HUNG", "\n".join(lines))

    def test_a_victim_that_did_not_die_by_its_kill_fails(self):
        self.assertTrue(self.judge({0: 3, 1: 3, 2: 3, 3: 1})[0])
        failed, lines = killed_rank.judge({0: (0, 1.0), 1: (0, 1.0)}, 2, 1, None, 120)
        self.assertTrue(failed)
        self.assertIn("the victim never died", "\n".join(lines))

    def test_without_a_victim_every_rank_exits_0(self):
        self.assertFalse(self.judge({0: 0, 1: 0, 2: 0, 3: 0}, victim=None)[0])
        self.assertTrue(self.judge({0: 0, 1: 3, 2: 0, 3: 0}, victim=None)[0])


class Verdict(unittest.TestCase):
    """tests/gpu/verdict.sh: the counts and the closing line."""

    def run_verdict(self, body: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as work:
            return bash(f'. "{HERE}/verdict.sh"\nwork={work}\n{body}', work)

    def test_skips_are_counted_in_the_closing_line(self):
        r = self.run_verdict('pass a; skip "b: no MPS"; skip c; closing_line gpu-tests')
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 1 passed, 0 failed, 2 skipped")

    def test_a_failure_fails_the_run(self):
        r = self.run_verdict("pass a; fail b; closing_line gpu-tests")
        self.assertEqual(r.returncode, 1)
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 1 passed, 1 failed, 0 skipped")

    def test_a_run_where_nothing_ran_fails(self):
        for body in ("closing_line gpu-tests", "skip a; skip b; closing_line gpu-tests"):
            r = self.run_verdict(body)
            self.assertEqual(r.returncode, 1, body)
            self.assertRegex(r.stdout, r"FAIL no check ran")
            self.assertRegex(r.stdout.splitlines()[-1], r"^gpu-tests: 0 passed, 1 failed, ")

    def test_nested_closing_lines_add_up(self):
        r = self.run_verdict(
            'printf "PASS x\\nmulti: 3 passed, 1 failed, 2 skipped\\n" >"$work/multi.log"\n'
            'printf "transport-faults: 4 passed, 0 failed\\n" >"$work/faults.log"\n'
            'printf "ended early\\n" >"$work/broken.log"\n'
            'add_counts multi "$work/multi.log"\n'
            'add_counts transport-faults "$work/faults.log"\n'
            'add_counts multi "$work/broken.log" || fail "no summary line"\n'
            "closing_line gpu-tests")
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 7 passed, 2 failed, 2 skipped")


class RunSelection(unittest.TestCase):
    """tests/gpu/run.sh itself, where a selection leaves nothing to run: it must fail, saying so
    in its closing line. nvidia-cuda-mps-control is a stand-in that fails to start, as it does
    where MPS cannot run."""

    def run_gpu_tests(self, only: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            build = os.path.join(tmp, "build")
            tools = os.path.join(tmp, "bin")
            os.makedirs(build)
            os.makedirs(tools)
            open(os.path.join(build, "libmagice.so"), "w").close()
            mps = os.path.join(tools, "nvidia-cuda-mps-control")
            with open(mps, "w") as f:
                f.write("#!/bin/sh\nexit 1\n")
            os.chmod(mps, 0o755)
            env = dict(os.environ, GPU_ONLY=only, PATH=tools + os.pathsep + os.environ["PATH"])
            return subprocess.run(["bash", os.path.join(HERE, "run.sh"), build], env=env,
                                  capture_output=True, text=True, timeout=60)

    def test_graphs_mps_without_mps_fails_with_its_skip_counted(self):
        r = self.run_gpu_tests("graphs-mps")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("SKIP MPS runs: the MPS control daemon did not start", r.stdout)
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 0 passed, 1 failed, 1 skipped")

    def test_torch_standin_without_mps_fails_with_its_skip_counted(self):
        r = self.run_gpu_tests("torch-standin")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("SKIP MPS runs: the MPS control daemon did not start", r.stdout)
        self.assertNotIn("== PyTorch over the stand-in", r.stdout)
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 0 passed, 1 failed, 1 skipped")

    def test_a_selection_of_nothing_fails(self):
        r = self.run_gpu_tests("nothing-by-this-name")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("FAIL GPU_ONLY=nothing-by-this-name selects nothing", r.stdout)
        self.assertEqual(r.stdout.splitlines()[-1], "gpu-tests: 0 passed, 1 failed, 0 skipped")


# The launcher's summary and the ranks' lines as a run on the GPU writes them.
LAUNCH = "magi-launch: /build/tests/support/magi-workload: "
CAPTURE_REFUSED = ("weights: ncclAllGather (captured into a CUDA graph) returned 5 (invalid "
                   "usage): device buffers on a stream capturing a CUDA graph are not supported")
STAYS = ("[{r}] MAGI INFO REWRITE comm 3f2a0c1d9e7b: the 6 gathers captured into a CUDA graph stay "
         "on NCCL on every rank")
REPLAY_FAILED = ("standin: rank 2: a replay of a CUDA graph: AllGather(int32, count 4096) returned "
                 "2: rank 2: blocked 60.0 s; the communicator is broken")
STANDIN_GAVE_UP = ("standin: rank 1: blocked 60.0 s in AllGather float32 x 4096 (seq 112) waiting "
                   "for rank 2; giving up (STANDIN_TIMEOUT_S)")


class StandinChecks(unittest.TestCase):
    """graph_runs.sh's and standin_runs.sh's checks, with launch_ranks replaced by one that
    writes the log and returns the status a run on the GPU would have."""

    def run_checks(self, call: str, logs: dict, statuses=None) -> str:
        statuses = statuses or {}
        with tempfile.TemporaryDirectory() as tmp:
            fixtures = os.path.join(tmp, "fixtures")
            work = os.path.join(tmp, "work")
            os.makedirs(fixtures)
            os.makedirs(work)
            for name, text in logs.items():
                with open(os.path.join(fixtures, name + ".log"), "w") as f:
                    f.write(text)
            for name, status in statuses.items():
                with open(os.path.join(fixtures, name + ".status"), "w") as f:
                    f.write(str(status))
            script = f"""
build=/nonexistent here="{HERE}" work="{work}" fixtures="{fixtures}"
. "$here/verdict.sh"
. "$here/standin_runs.sh"
. "$here/graph_runs.sh"
launch_ranks() {{
  mkdir -p "$work/$1"
  cat "$fixtures/$1.log" >"$work/$1/log" 2>/dev/null || : >"$work/$1/log"
  return "$(cat "$fixtures/$1.status" 2>/dev/null || echo 0)"
}}
{call}
"""
            r = bash(script, tmp)
            self.assertEqual(r.stderr, "")
            return r.stdout

    def verdict_of(self, out: str, name: str) -> str:
        lines = [line for line in out.splitlines() if re.match(f"(PASS|FAIL) {name}: ", line)]
        self.assertEqual(len(lines), 1, out)
        return lines[0].split()[0]

    # graph_runs.sh: the captured gathers stay on NCCL, the stand-in replays them; none hung.
    def stayed(self, lines, status=0):
        name = "mps-weights-graph-default"
        call = f"launch_ranks {name}; graph_stayed_check {name} 3 {status}"
        return self.verdict_of(self.run_checks(call, {name: "\n".join(lines) + "\n"}), name)

    def test_every_rank_replayed_its_captured_gathers_passes(self):
        self.assertEqual(self.stayed([STAYS.format(r=r) for r in range(3)]), "PASS")

    def test_a_rank_refused_at_its_capture_fails(self):
        refused = [STAYS.format(r=r) for r in range(3)] + [CAPTURE_REFUSED]
        self.assertEqual(self.stayed(refused, status=1), "FAIL")

    def test_a_rank_the_standin_gave_up_on_fails(self):
        # One rank blocked in a collective until the stand-in gave up: a hang, which says
        # "giving up", never "timed out" (the launcher's word, 60 s later).
        hung = [STAYS.format(r=r) for r in range(3)] + [STANDIN_GAVE_UP]
        self.assertEqual(self.stayed(hung), "FAIL")

    def test_a_failed_replay_fails_even_at_exit_0(self):
        failed = [STAYS.format(r=r) for r in range(3)] + [REPLAY_FAILED]
        self.assertEqual(self.stayed(failed), "FAIL")

    def test_a_launcher_timeout_fails(self):
        self.assertEqual(self.stayed([STAYS.format(r=r) for r in range(3)], status=124), "FAIL")

    def test_gathers_that_did_not_stay_on_nccl_fail(self):
        self.assertEqual(self.stayed(["weights: rank 0: step 16: ok"]), "FAIL")

    # standin_runs.sh: a rank killed with gathers moving.
    def killed_peer(self, summary: str, extra=()):
        nccl_error = ("fsdp: ncclAllGather(shard, full, count, ncclFloat32, comm, stream) returned "
                      "6 (remote process exited or there was a network error): rank 1: rank 2 "
                      "exited while AllGather waits for it; giving up")
        log = "\n".join([nccl_error, *extra, LAUNCH + summary]) + "\n"
        name = "fault-killed-peer-6"
        out = self.run_checks("standin_fault_runs", {name: log, "fault-killed-peer-14": log},
                              {name: 1, "fault-killed-peer-14": 1})
        return self.verdict_of(out, name)

    def test_survivors_ended_by_the_standin_or_the_watchdog_pass(self):
        summary = ("rank 0 exited 3; rank 1 exited 1; rank 2 killed by signal 9 (Killed); "
                   "rank 3 exited 3 (7.10 s)")
        self.assertEqual(self.killed_peer(summary), "PASS")

    def test_a_survivor_that_received_a_wrong_byte_fails(self):
        summary = ("rank 0 exited 3; rank 1 exited 1; rank 2 killed by signal 9 (Killed); "
                   "rank 3 exited 3 (7.10 s)")
        wrong = "fsdp: rank 1: step 6 layer 0: gathered weight 12 is 0, expected 3.5"
        self.assertEqual(self.killed_peer(summary, [wrong]), "FAIL")

    def test_a_survivor_that_ran_on_or_crashed_fails(self):
        ran_on = "rank 0 exited 3; rank 2 killed by signal 9 (Killed); rank 3 exited 3 (7.10 s)"
        self.assertEqual(self.killed_peer(ran_on), "FAIL")
        crashed = ("rank 0 exited 3; rank 1 killed by signal 11 (Segmentation fault); rank 2 "
                   "killed by signal 9 (Killed); rank 3 exited 3 (7.10 s)")
        self.assertEqual(self.killed_peer(crashed), "FAIL")


END_LINE = ("h:7:7 [{r}] MAGI INFO REWRITE comm 3f2a0c1d9e7b: {m} of {g} all-gathers ({m}0 of {g}0 "
            "bytes sent) served off NCCL, 0 fell back to NCCL; exploring cost 1.0 ms")


class TorchStandinChecks(unittest.TestCase):
    """torch_standin_runs.sh's checks on made-up job directories: the share of gathers moved,
    a program this PyTorch lacks, a job that failed or timed out."""

    def run_checks(self, call: str, jobs: dict) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            for name, (log, rc) in jobs.items():
                os.makedirs(os.path.join(tmp, name, "out"))
                with open(os.path.join(tmp, name, "log"), "w") as f:
                    f.write(log)
                with open(os.path.join(tmp, name, "rc"), "w") as f:
                    f.write(str(rc))
            script = f"""
build=/nonexistent here="{HERE}" work="{tmp}" torch_python=false
. "$here/verdict.sh"
. "$here/torch_standin_runs.sh"
{call}
"""
            r = bash(script, tmp)
            self.assertEqual(r.stderr, "")
            return r.stdout

    def test_the_share_moved_sums_every_ranks_end_line(self):
        log = "\n".join(END_LINE.format(r=r, m=m, g=16) for r, m in ((0, 12), (1, 12))) + "\n"
        out = self.run_checks("torch_standin_moved 2 a b", {"a": (log, 0), "b": ("", 0)})
        self.assertIn("PASS torch-standin-2: the library moved 24 of 32 all-gathers off NCCL "
                      "(75%; 2 end-of-communicator lines)", out)

    def test_no_end_line_fails(self):
        out = self.run_checks("torch_standin_moved 4 a", {"a": ("torch_standin: done\n", 0)})
        self.assertIn("FAIL torch-standin-4: the library's end-of-communicator lines", out)

    def test_a_program_this_pytorch_lacks_is_a_skip_with_its_reason(self):
        line = "torch_standin: world 2: compile: unavailable: Triton is missing\n"
        out = self.run_checks("torch_standin_compare 2 compile p m",
                              {"p": (line, 0), "m": (line, 0)})
        self.assertIn("SKIP torch-standin-2 compile: Triton is missing", out)
        self.assertNotIn("PASS", out)

    def test_missing_results_fail_the_comparison(self):
        out = self.run_checks("torch_standin_compare 2 fsdp2 p m", {"p": ("", 0), "m": ("", 0)})
        self.assertIn("FAIL torch-standin-2 fsdp2: bitwise equal with and without the library "
                      "(ranks 0 1 differ or lack results)", out)

    def test_a_job_that_timed_out_or_failed_fails(self):
        out = self.run_checks("torch_standin_ran a 'ran'; torch_standin_ran b 'ran'; "
                              "torch_standin_ran c 'ran'",
                              {"a": ("", 0), "b": ("", 124), "c": ("Traceback\n", 1)})
        self.assertIn("PASS a: ran", out)
        self.assertIn("FAIL b: ran (timed out after", out)
        self.assertIn("FAIL c: ran (exit 1)", out)


if __name__ == "__main__":
    unittest.main()
