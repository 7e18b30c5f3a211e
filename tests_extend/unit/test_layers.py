"""The layer rules of docs/architecture.md hold: import-linter's contracts (.importlinter) are kept."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_every_import_linter_contract_is_kept():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_a_feature_reaching_up_into_the_adaptor_breaks_the_layers(tmp_path):
    # The contracts catch what they are for: a copy of the package whose documents module reads the
    # adaptor's state again (the hidden channel the layers removed) is refused.
    import shutil
    copy = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "mindspeed"), copy / "mindspeed",
                    ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), copy / ".importlinter")
    documents = copy / "mindspeed" / "features" / "documents.py"
    documents.write_text(documents.read_text() + "\n\ndef _state():\n    from mindspeed.adaptor_core import plan\n"
                         "    return plan()\n")
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = dict(os.environ, PYTHONPATH=str(copy))
    done = subprocess.run([lint, "--no-cache"], cwd=copy, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "mindspeed.features.documents -> mindspeed.adaptor_core" in done.stdout, done.stdout[-2000:]
