"""The README keeps exactly two set-up commands, and CI runs the test one in a fresh venv, then the suite again
against a second Megatron-Core release."""

import os
import re

import pytest

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "launch/torchrun.py --nproc_per_node 2 recipes/finetune.py" in main_job  # torchrun, one-line failures
    assert "pytest" in tests
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert tests in ci
    # a fresh virtual environment is made before the README's command runs (a dependency missing from setup.py fails)
    assert "-m venv" in ci.split(tests, 1)[0]
    # then a second suite runs after .ci/install_megatron_core.sh has put in another Megatron-Core release
    after = ci.split(tests, 1)[1]
    assert "-m venv" in after
    assert "pytest" in after.split("bash .ci/install_megatron_core.sh", 1)[1]
    assert os.path.exists(os.path.join(ROOT, ".ci", "install_megatron_core.sh"))
