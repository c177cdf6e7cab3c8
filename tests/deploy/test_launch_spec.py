#!/usr/bin/env python3
"""launch_spec.py turns the rendered cpu overlay's pods into the processes netns_e2e.sh starts.

Runs without root, so the derivation the namespace test relies on is checked on every run.
  test_launch_spec.py RENDERED_CPU_YAML
"""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
RENDERED = sys.argv.pop(1) if len(sys.argv) > 1 else None


def spec(*args):
    """Runs launch_spec.py and evaluates its output in bash; returns (binary, env dict, args)."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "launch_spec.py"), RENDERED, *args],
                         capture_output=True, text=True, check=True).stdout
    script = out + '\nprintf "%s\\0" "$SPEC_BINARY"; printf "%s\\0" "${#SPEC_ENV[@]}"' \
                   '; printf "%s\\0" "${SPEC_ENV[@]}" "${SPEC_ARGS[@]}"'
    fields = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                            check=True).stdout.split("\0")[:-1]
    binary, n = fields[0], int(fields[1])
    env = dict(kv.split("=", 1) for kv in fields[2:2 + n])
    return binary, env, fields[2 + n:]


class LaunchSpecTest(unittest.TestCase):

    def test_worker_gets_rank_address_and_sizing(self):
        with tempfile.TemporaryDirectory() as root:
            binary, env, args = spec("worker", root, "--pod-name", "hsdp-worker-3",
                                     "--pod-index", "3", "--pod-ip", "10.251.7.23",
                                     "--node-name", "node-b",
                                     "--set", "HSDP_STEPS=5", "--arg=--collective-timeout=7")
            self.assertEqual(binary, "hsdp-worker")
            self.assertEqual(env["HSDP_RANK_HINT"], "3")
            self.assertEqual(env["POD_NAME"], "hsdp-worker-3")
            self.assertEqual(env["HSDP_GLOO_HOSTNAME"], "10.251.7.23")
            self.assertEqual(env["HSDP_HOST_ID"], "node-b")
            self.assertEqual(env["HSDP_COORDINATOR"], "hsdp-coordinator:50051")
            self.assertEqual(env["HSDP_MODEL"], "gpt-tiny")
            self.assertEqual(env["HSDP_STEPS"], "5")
            self.assertEqual(env["HSDP_THREADS"], "2")  # limits.cpu of the cpu overlay
            self.assertEqual(env["HSDP_CHECKPOINT_DIR"],
                             os.path.join(root, "var/lib/hsdp/checkpoints"))
            self.assertTrue(os.path.isdir(env["HSDP_CHECKPOINT_DIR"]))
            self.assertIn("--collective-timeout=7", args)
            self.assertNotIn("--collective-timeout=300", args)
            self.assertIn(f"--report-file={root}/run/hsdp/report.jsonl", args)

    def test_coordinator_files_come_from_configmap_and_secret(self):
        with tempfile.TemporaryDirectory() as root:
            binary, env, args = spec("coordinator", root)
            self.assertEqual(binary, "hsdp-coordinator")
            self.assertEqual(env["HSDP_WORLD_SIZE"], "4")
            self.assertEqual(env["HSDP_MESH"], "2x2")
            with open(env["HSDP_POLICY_FILE"], encoding="utf-8") as f:
                self.assertIn("reshardAfterForward", f.read())
            with open(env["HSDP_CONTROL_TOKEN_FILE"], encoding="utf-8") as f:
                self.assertTrue(f.read().strip())
            self.assertTrue(os.path.isdir(env["HSDP_STATE_DIR"]))
            self.assertIn("--shutdown-deadline=30", args)


if __name__ == "__main__":
    unittest.main(verbosity=2)
