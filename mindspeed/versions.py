"""Pinned versions, in one place (setup.py, .ci/run and auto_convert_llm.sh read this file).
torch must stay pinned: an unpinned `torch` pulls a multi-GB CUDA build on CPU machines."""
MINDSPEED = "0.1.0"
# the Pythons MindSpeed supports: 3.11 (torch 2.13, mindspore 2.10 and megatron-core 0.16.1 all have
# 3.11 builds; tested on 3.11.2, Debian 12's /usr/bin/python3, and 3.11.7)
PYTHON_REQUIRES = ">=3.11,<3.12"
PYTHON_SUPPORTED = (3, 11)
TORCH = "torch==2.13.0"
MEGATRON_CORE = "megatron-core==0.16.1"
NUMPY = "numpy<2"           # mindspore 2.10 is built against numpy 1.x
MINDSPORE = "mindspore==2.10.0"

# psutil: Megatron-Core's dist-checkpoint save imports it (every --save needs it)
CORE_REQUIREMENTS = [TORCH, MEGATRON_CORE, NUMPY, "ninja==1.13.2", "safetensors==0.8.0", "tensorboard==2.21.0",
                     "psutil==7.2.2"]
MINDSPORE_REQUIREMENTS = [MINDSPORE, NUMPY]
TRANSFORMERS = "transformers==5.23.0"
PYYAML = "pyyaml==6.0.3"
# `python -m mindspeed.data` with Hugging Face tokenizers, parquet inputs and --config YAML files (and the
# trainers' Llama2Tokenizer: a SentencePiece model):
# `pip install -e ".[data]"` (pyarrow 17 is the last line that supports numpy<2, which mindspore needs)
DATA_REQUIREMENTS = [TRANSFORMERS, "pyarrow==17.0.0", PYYAML, "sentencepiece==0.2.2"]
# matplotlib: `python -m mindspeed plot` (`pip install -e ".[plot]"`); the tests draw with it too
PLOT_REQUIREMENTS = ["matplotlib==3.11.2"]
# transformers: the conversion tests build tiny Llama/Qwen2 models and compare their logits, the data
# tests tiny tokenizers; pyarrow: parquet inputs; hypothesis: the property-based flag test
# (tests_extend/unit/test_flag_properties.py)
# import-linter: the layer contracts in .importlinter, checked by `lint-imports` in .ci/run
TEST_REQUIREMENTS = ["pytest==9.2.0", "pytest-timeout==2.3.1", "pytest-xdist==3.8.0", *DATA_REQUIREMENTS, "hypothesis==6.170.15",
                     *PLOT_REQUIREMENTS, "import-linter==2.16",
                     # Megatron's test_bert_model.py imports it (tests_extend/system/test_megatron_core_tests.py runs it)
                     "pytest-mock==3.17.0"]
# Megatron-Core's own unit tests (.ci/megatron_core_tests, docs/megatron-core-tests.md): their imports, and
# triton, whose CPU interpreter runs Megatron's Triton kernels (the MoE dispatcher's). Not in `test`:
# Megatron-Core imports triton wherever it is installed, about 0.15 CPU-s more in every process of the suite
# (docs/performance.md); `pip install -e ".[megatron-core-tests]"` before that stage
MEGATRON_CORE_TESTS_REQUIREMENTS = ["mock==5.2.0", "triton==3.5.1", "httpx==0.28.1", "wrapt==2.5.2"]
# what Megatron-LM's megatron.training imports beyond megatron-core (pybind11 builds its dataset
# helpers; einops for core_v0.12); `pip install -e ".[megatron-lm]"`
MEGATRON_LM_REQUIREMENTS = ["regex==2026.11.15", PYYAML, "pydantic==2.14.3", "pybind11==3.1.0",
                            "einops==0.8.2"]

# Source checkouts auto_convert_llm.sh --fetch can add (git URL, full commit id: never a branch).
# A commit left as None is not fetched (the script says so). Megatron-LM's commit is the tag the
# system tests run (tests_extend/system/test_megatron_lm.py; core_v0.12.1 is a845aa7e12b3a117e24c2352b9e3e60bad2e3a17).
GIT_PINS = {
    "MSAdapter": ("https://openi.pcl.ac.cn/OpenI/MSAdapter.git", None),
    "Megatron-LM": ("https://github.com/NVIDIA/Megatron-LM.git",
                    "55ac7082517c3878ae653c07c09c534b8aed49f6"),   # tag core_v0.16.1
}


def megatron_version() -> str:
    """The Megatron-Core version importable here (the wheel, or Megatron-LM's source tree)."""
    import importlib
    return importlib.import_module("megatron.core.package_info").__version__


if __name__ == "__main__":   # `python mindspeed/versions.py [extra...]` prints pip requirement lines
    import sys
    if sys.argv[1:] == ["--check-python"]:       # auto_convert_llm.sh: one line, exit 1, on another Python
        if sys.version_info[:2] != PYTHON_SUPPORTED:
            print(f"Python {sys.version.split()[0]} ({sys.executable}) is not supported: MindSpeed needs Python "
                  f"{PYTHON_REQUIRES} (pass --python with a 3.11 interpreter)")
            sys.exit(1)
        sys.exit(0)
    groups = {"core": CORE_REQUIREMENTS, "mindspore": MINDSPORE_REQUIREMENTS, "test": TEST_REQUIREMENTS,
              "megatron-core-tests": MEGATRON_CORE_TESTS_REQUIREMENTS, "megatron-lm": MEGATRON_LM_REQUIREMENTS, "data": DATA_REQUIREMENTS, "plot": PLOT_REQUIREMENTS}
    for name in sys.argv[1:] or ["core"]:
        print("\n".join(groups[name]))
