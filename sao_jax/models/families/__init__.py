"""Model families: one small module per HF architecture over the shared layers.

Importing this package registers every family (`registry.py`); to add one,
write `families/<family>.py` (its `from_hf` / `to_hf`, tensor-name
differences, a `registry.register` call) and import it below
(docs/design/extending.md "A model family").
"""

# The import order is `SUPPORTED_ARCHITECTURES`' order.
from sao_jax.models.families import llama  # pylint: disable=unused-import
from sao_jax.models.families import qwen2  # pylint: disable=unused-import
from sao_jax.models.families import qwen3  # pylint: disable=unused-import
from sao_jax.models.families import qwen3_moe  # pylint: disable=unused-import
from sao_jax.models.families import glm4_moe  # pylint: disable=unused-import
from sao_jax.models.families import mistral  # pylint: disable=unused-import
from sao_jax.models.families import gemma3  # pylint: disable=unused-import
from sao_jax.models.families import phi3  # pylint: disable=unused-import
from sao_jax.models.families import smollm3  # pylint: disable=unused-import
from sao_jax.models.families import olmo2  # pylint: disable=unused-import
from sao_jax.models.families import olmo3  # pylint: disable=unused-import
from sao_jax.models.families import deepseek_v3  # pylint: disable=unused-import
from sao_jax.models.families import qwen3_5  # pylint: disable=unused-import
from sao_jax.models.families import gemma4  # pylint: disable=unused-import
from sao_jax.models.families import qwen3_next  # pylint: disable=unused-import
