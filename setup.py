"""MindSpeed: `pip install -e .` (torch backend) or `pip install -e ".[mindspore]"` (both).
Versions are pinned in one place: mindspeed/versions.py (also read by auto_convert_llm.sh)."""
import os
import runpy

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
V = runpy.run_path(os.path.join(HERE, "mindspeed", "versions.py"))

setup(
    name="mindspeed",
    version=V["MINDSPEED"],
    description="Acceleration and portability layer for Megatron-Core training (torch and MindSpore backends)",
    packages=find_packages(include=["mindspeed", "mindspeed.*"]),
    package_data={"mindspeed": ["backends/torch/kernels/csrc/*"]},
    python_requires=V["PYTHON_REQUIRES"],
    install_requires=V["CORE_REQUIREMENTS"],
    extras_require={"mindspore": V["MINDSPORE_REQUIREMENTS"], "test": V["TEST_REQUIREMENTS"],
                    "megatron-core-tests": V["MEGATRON_CORE_TESTS_REQUIREMENTS"],
                    "megatron-lm": V["MEGATRON_LM_REQUIREMENTS"], "data": V["DATA_REQUIREMENTS"],
                    "plot": V["PLOT_REQUIREMENTS"]},
    entry_points={"console_scripts": ["mindspeed=mindspeed.__main__:main"]},
)
