"""No pointer to nothing (tests/docs/stale_paths.py): every path that a doc (*.md anywhere), a
Python file or a script (scripts/, launch/, .ci/, examples/) mentions is a file of the checkout or of
an installed package, or is listed below as not ours to have, with why. A listed mention that is no
longer made is reported too, so the list cannot outlive what it excuses."""
from __future__ import annotations

import subprocess

from stale_paths import stale_mentions

# Paths in other repositories: the peers whose configs `migrate` reads and whose formulas the tests
# transcribe, DeepSeek-V3's repository, Transformer Engine's and flash-linear-attention's sources
# (installed on GPUs only).
ELSEWHERE = ("roll/", "verl/", "slime/", "inference/fp8_cast_bf16.py", "dot_product_attention/utils.py",
             "transformer_engine/pytorch/", "fla/")
# Files that are not ours to have, by the file that names them.
NOT_OURS = {
    # the plug-in package each recipe has the reader create, outside the repository
    # (tests/docs/test_extending_recipes.py makes them)
    "docs/extending.md": {f"my_ext/{m}.py" for m in ("__init__", "cispo", "std_floor", "near_number", "terms",
                                                      "toy_sync", "mistral", "csv_prompts", "retry_env")},
    "docs/rewards.md": {"my_rewards.py"},  # the reader's own module
    # what scripts/gpu_acceptance.sh writes into its output folder
    "docs/gpu.md": {"summary.md", "summary_all.md"},
    "scripts/gpu_acceptance.sh": {"PREFIX.md", "summary.md", "summary_all.md"},
    "tests/scripts/test_gpu_acceptance.py": {"summary.md", "summary_all.md", "x.py",
                                             "examples/qwen3_235b.yaml"},  # and a rotted name
    # the peers' own files that the examples carry over
    "examples/tiny_moe_slime_gspo.yaml": {"tests/test_gspo.sh"},
    "examples/tiny_moe_verl_gspo.yaml": {"examples/gspo_trainer/run_qwen30b_gspo.sh"},
    # files a test writes, and modules a test plants
    "tests/checkpoint/test_checkpoint_manager.py": {"save.py"},
    "tests/config/test_migrate.py": {"flags.sh"},
    "tests/config/test_migrate_first_hour.py": {"run_gspo.sh", "flags.sh"},
    "tests/config/test_migrate_mappings.py": {"slime.sh"},
    "tests/benchmarks/test_moe_stability.py": {"examples/nope.yaml"},  # a config that is not there
    "tests/launch/test_slurm.py": {"allreduce.sh"},
    "tests/parallel/test_comm.py": {"gspo_megatron/fake_module.py"},
    "tests/tools/test_check_imports.py": {"rollout/servers/m13.py", "gspo_megatron/helpers.py",
                                          "gspo_megatron/actor/microbatches.py", "m13.py"},
    "tests/tools/test_resolve_imports.py": {"gpu_only.py", "broken.py", "entry.py", "typed.py"},
    "tests/docs/stale_paths.py": {"some/path.py"},  # its docstring's example
}


def _excused(file: str, mention: str) -> bool:
    # this file names the excused mentions and plants stale ones
    return mention.startswith(ELSEWHERE) or mention in NOT_OURS.get(file, ()) or file == "tests/docs/test_stale_paths.py"


def test_every_mentioned_path_is_a_file():
    found = [line.split(": ", 1) for line in stale_mentions()]
    stale = [f"{where}: {mention}" for where, mention in found if not _excused(where.rsplit(":", 1)[0], mention)]
    assert stale == []
    made = {(where.rsplit(":", 1)[0], mention) for where, mention in found}
    unused = sorted((f, m) for f, mentions in NOT_OURS.items() for m in mentions if (f, m) not in made)
    assert unused == [], "listed as not ours, but no longer mentioned there"
    assert all(any(m.startswith(prefix) for _, m in found) for prefix in ELSEWHERE)


def test_docs_scripts_and_examples_are_read(tmp_path):
    """Planted pointers to nothing in each kind of file the check reads are named; existing files,
    a glob that matches, a path after a root variable, and a bare config name are not."""
    files = {
        "gspo_megatron/real.py": '"""See docs/guide.md."""\n',
        "docs/guide.md": "The code: `gspo_megatron/real.py`, `gspo_megatron/gone.py`.\n",
        "tools/notes/deep.md": "An old name: `tools/renamed.py`.\n",
        "launch/common.sh": "# README_clusters.md is the user's guide\nsource \"$ROOT/launch/local.sh\"\n",
        "launch/local.sh": 'bash "$GSPO_ROOT/launch/missing.sh"\n',
        "launch/slurm/job.sbatch": "srun bash ${GSPO_ROOT}/launch/common.sh CONFIG.yaml\n",
        ".ci/run": "bash scripts/nope.sh\n",
        "scripts/test.sh": "pytest tests/test_real_*.py tests/test_none_*.py\n",
        "tests/test_real_one.py": "",
        "examples/run.yaml": "# from examples/other.yaml; see gspo_megatron/real.py\n",
        "examples/data/rows.jsonl": '{"prompt": "what does gspo_megatron/absent.py do?"}\n',
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert sorted(stale_mentions(tmp_path)) == [
        ".ci/run:1: scripts/nope.sh",
        "docs/guide.md:1: gspo_megatron/gone.py",
        "examples/run.yaml:1: examples/other.yaml",
        "launch/common.sh:1: README_clusters.md",
        "launch/local.sh:1: launch/missing.sh",
        "scripts/test.sh:1: tests/test_none_*.py",
        "tools/notes/deep.md:1: tools/renamed.py",
    ]
