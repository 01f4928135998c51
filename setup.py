"""Packaging for sao_jax: Single-rollout Asynchronous Optimization in JAX."""

import setuptools

setuptools.setup(
    name="sao_jax",
    version="0.1.0",
    description=(
        "Asynchronous RL post-training of LLM policies with SAO "
        "(Single-rollout Asynchronous Optimization) in JAX/Flax."
    ),
    packages=setuptools.find_packages(include=["sao_jax", "sao_jax.*", "configs"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10,<0.13",
        "jaxlib>=0.10,<0.13",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "grain>=0.2.18,<0.3",
        "sentencepiece>=0.2,<0.3",
        "ml-collections>=1.1,<2",
        "tensorboard>=2.21,<3",
        "reasoning-gym>=0.1.25,<0.2",
        "absl-py>=2.1,<3",
        "numpy>=2.0,<3",
        "xxhash>=3.4,<5",  # Ring record checksums (sao_jax/ipc/ring.py).
        "rich>=13,<16",
        "matplotlib>=3.8,<4",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "hypothesis>=6.100,<7",
            "chex>=0.1.90,<0.2",
            "psutil>=5.9",
        ],
        "ref": [
            "torch==2.13.0",
            "transformers>=5.0,<6",
            "safetensors>=0.4,<1",
        ],
    },
)
