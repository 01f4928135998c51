"""Tokenizers and chat templates (docs/design/models.md "Tokenizer and chat
template").

`text_tokenizer.TextTokenizer` is the interface the sampler, environments, SFT
and eval use; `tokenizer.Tokenizer` is sao_jax's own SentencePiece model with
`chat_template.SAO_MARKUP`; `hf_tokenizer.HFTokenizer` a pretrained model's
`tokenizer.json` with its own Jinja chat template, read by
`jinja_template.template_from_jinja`. `tokenizer.tokenizer_from_config` picks
one from the config. (Named `tokenization`, not `tokenizers`, so that it never
shadows the HF `tokenizers` library.)
"""
