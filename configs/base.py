r"""Base config: SAO on reasoning-gym arithmetic with a tiny CPU-sized model.

Every experiment config starts from this one (big_vision style) and only sets
keys that exist here; `sao_jax.config_validation.validate_config` rejects any
other key. Run:

  python -m sao_jax.main --config=configs/base.py --workdir=/tmp/sao \
      --config.rl.eps_low=0.2 --config.train.mode=sync
"""

import ml_collections
from ml_collections import config_dict

from sao_jax import sharding


def get_config() -> ml_collections.ConfigDict:
  """The default hyper-parameters (paper defaults where the paper gives one)."""
  config = ml_collections.ConfigDict()

  # ---------------------------------------------------------------- model ---
  # Decoder LM (sao_jax.models.config.ModelConfig fields) shared by the policy
  # and the value model (same backbone + scalar head).
  config.model = ml_collections.ConfigDict()
  # HF checkpoint dir (safetensors + config.json) or orbax dir to start from;
  # '' = random init (then SFT, see train.sft_steps). When set, the
  # architecture fields below must match the checkpoint.
  config.model.init_from = ""
  # >= the tokenizer's size; 0 = the tokenizer's size rounded up to a
  # multiple of 64 (docs/design/envs.md "Settings that follow the task").
  config.model.vocab_size = 512
  config.model.hidden_size = 64  # Residual width ('embed').
  config.model.intermediate_size = 128  # SwiGLU width ('mlp').
  config.model.num_layers = 2  # Decoder blocks.
  config.model.num_heads = 4  # Query heads ('heads').
  config.model.num_kv_heads = 2  # GQA key/value heads; divides num_heads.
  config.model.head_dim = 16  # Need not equal hidden_size // num_heads.
  config.model.rope_theta = 10000.0  # RoPE base frequency.
  # RoPE scaling (free-form; empty: none): HF rope_parameters, e.g.
  # {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
  # 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}.
  config.model.rope_scaling = ml_collections.ConfigDict()
  config.model.rms_norm_eps = 1e-6  # RMSNorm epsilon.
  config.model.qkv_bias = False  # Qwen2: True.
  config.model.qk_norm = False  # Per-head RMSNorm on q and k (Qwen3: True).
  # With qk_norm: one RMSNorm over all heads' q (and k) at once (OLMo 2/3).
  config.model.qk_norm_full_width = False
  config.model.tie_embeddings = False  # Output proj = embedding^T.
  config.model.dtype = "float32"  # Activations ('bfloat16' on TPU/GPU).
  config.model.param_dtype = "float32"  # Parameter storage dtype.
  # Tokens per chunk of the trainer's log-probs/entropy over the vocabulary
  # (no [B, T, V] logits; same numbers); 0 = full logits in one piece.
  config.model.logits_chunk = 2048
  # Attention core: 'auto' (cuDNN on GPU, splash on TPU, blockwise or, for one
  # block, dense on CPU), 'dense' (reference), 'blockwise', 'cudnn', 'splash'.
  config.model.attention = "auto"
  config.model.attention_block_q = 512  # Query block (blockwise, splash).
  config.model.attention_block_kv = 512  # Key/value block (blockwise).
  # Layers under nn.scan over stacked params (one compiled layer body);
  # False: the unrolled reference (docs/design/models.md "Layer layout").
  config.model.scan_layers = True
  # What each block keeps for the backward: 'none' (all), 'full' (recompute
  # the block), 'dots_saveable', 'dots_with_no_batch_dims_saveable'.
  config.model.remat_policy = "none"
  # Mixture of experts (docs/design/models.md "Mixture of experts"): 0 experts =
  # a dense model. router 'softmax' (Qwen3-MoE) or 'sigmoid' (GLM-4.5 /
  # DeepSeek-V3: grouped top-k, score-correction bias, routed scaling).
  # Shared experts: their width (0: n_shared_experts x intermediate_size)
  # and a sigmoid gate on their output (Qwen3-Next).
  config.model.moe = ml_collections.ConfigDict({
      "num_experts": 0, "top_k": 2, "intermediate_size": 0,
      "router": "softmax", "norm_topk_prob": True, "n_group": 1,
      "topk_group": 1, "routed_scaling_factor": 1.0, "n_shared_experts": 0,
      "shared_intermediate_size": 0, "shared_expert_gate": False})
  config.model.first_dense_layers = 0  # Dense layers before the MoE ones.
  config.model.rotary_dim = 0  # Channels RoPE rotates (0: all; GLM: half).
  # Sliding attention window of every layer (Mistral): a query sees keys
  # fewer than this many tokens back; 0 = full causal attention.
  config.model.sliding_window = 0
  # Gemma 3 (docs/design/extending.md "A model family"): per-layer
  # 'sliding_attention' / 'full_attention' (() = all alike), the sliding layers'
  # RoPE base (0: as rope_theta), scores / sqrt(query_pre_attn_scalar) (0:
  # head_dim), 'gemma' norms ((1 + w), post-attention/MLP norms, sqrt(d)
  # embeddings) and the gated MLP's activation ('silu' or 'gelu_tanh').
  config.model.layer_types = ()
  config.model.local_rope_theta = 0.0
  config.model.query_pre_attn_scalar = 0.0
  config.model.norm_style = "llama"
  # Layers without RoPE (SmolLM3's NoPE layers), e.g. (3, 7, 11); () = none.
  config.model.nope_layers = ()
  # Multi-head latent attention (DeepSeek-V3; models/layers/mla.py) when
  # kv_lora_rank > 0: the cached latent's width, the query bottleneck (0:
  # none), each head's rotated channels (of head_dim) and value width.
  config.model.kv_lora_rank = 0
  config.model.q_lora_rank = 0
  config.model.qk_rope_head_dim = 0
  config.model.v_head_dim = 0
  config.model.mlp_activation = "silu"
  # Qwen3.5's hybrid decoder (layer_types 'linear_attention'; models/layers/
  # linear_attention.py): full-attention layers with a per-head output gate
  # from q_proj, and the Gated DeltaNet layers' sizes (0: none).
  config.model.attn_output_gate = False
  config.model.linear_num_key_heads = 0
  config.model.linear_num_value_heads = 0
  config.model.linear_key_head_dim = 0
  config.model.linear_value_head_dim = 0
  config.model.linear_conv_kernel_dim = 0
  # Gemma 4 (norm_style 'gemma4'): the 'full_attention' layers' head width
  # and key/value heads (0: as the sliding layers), values = their k_proj
  # output, and logits = cap * tanh(logits / cap) (0: none).
  config.model.global_head_dim = 0
  config.model.global_kv_heads = 0
  config.model.attention_k_eq_v = False
  config.model.final_logit_softcapping = 0.0
  # Gemma 4's E2B / E4B: per-layer embeddings' width (0: none), the last
  # layers attending with an earlier layer's keys and values, and those
  # layers' MLPs twice as wide.
  config.model.per_layer_input_size = 0
  config.model.kv_shared_layers = 0
  config.model.double_wide_mlp = False
  # Routing replay (R3): 'rollout' makes the trainer's forward use the
  # experts the sampler recorded for every token (gate weights recomputed,
  # so the router still learns); 'off' routes on its own.
  config.model.routing_replay = "off"
  # Weight of the router's load-balancing loss in the policy loss.
  config.model.router_aux_loss_coef = 0.0

  # ------------------------------------------------------------ tokenizer ---
  config.tokenizer = ml_collections.ConfigDict()
  # SentencePiece .model file; '' = train one (settings below) into the
  # workdir on first start.
  config.tokenizer.path = ""
  # Exact size; 0 = at most 512 pieces (soft limit), or what the corpus's
  # characters need if more.
  config.tokenizer.vocab_size = 512
  config.tokenizer.seed = 0
  # reasoning-gym datasets whose problems form the training corpus; () = the
  # run's own env.dataset with its env.dataset_config.
  config.tokenizer.datasets = ("basic_arithmetic", "chain_sum",
                               "leg_counting", "letter_counting")
  config.tokenizer.corpus_size = 1000  # Problems per dataset.

  # ------------------------------------------------------------------ env ---
  config.env = ml_collections.ConfigDict()
  # 'reasoning_gym' (single turn), 'tool' (multi-turn calculator tool use) or
  # 'evolving' (online-learning simulation with a changing required style).
  config.env.name = "reasoning_gym"
  config.env.dataset = "basic_arithmetic"  # reasoning_gym.create_dataset name.
  # Keyword arguments for reasoning_gym.create_dataset (free-form).
  config.env.dataset_config = ml_collections.ConfigDict()
  # Text appended to every question (e.g. the required answer format).
  config.env.instruction = ""
  # A pretrained model's chat template (tokenizer.path a HF directory):
  # variables passed to it (free-form, e.g. {'enable_thinking': False} for
  # Qwen3, {'date_string': '26 Jul 2024'} for Llama 3) and a system message
  # ('' for none). sao_jax/tokenization/jinja_template.py.
  config.env.chat_template_kwargs = ml_collections.ConfigDict()
  config.env.system_prompt = ""
  # How the reply becomes the scored answer (sao_jax.envs.answers): 'whole',
  # 'last_number', 'answer_tag' or 'answer_tag_or_last_number'. Training
  # reward and held-out accuracy use the same rule.
  config.env.answer = "whole"
  # How reasoning-gym's score becomes the reward: 'exact' = 1 iff full credit;
  # 'score' = the score itself, which pays partial credit to wrong answers that
  # contain the right one ('-7' for 7 earns 0.5). Held-out accuracy is 'exact'.
  config.env.reward = "exact"
  config.env.seed = 0  # Training problems' seed.
  config.env.size = 100_000  # Number of training problems.
  # Held-out problems: seeds disjoint from the training ones [0, size).
  config.env.eval_seed = 10_000_000
  config.env.eval_size = 256  # Held-out problems per evaluation.
  # '' = held-out problems of env.dataset; 'humaneval' = HumanEval's problems
  # (evaluation only; the `code` extra; docs/design/grading.md "HumanEval").
  config.env.eval_dataset = ""
  config.env.max_turns = 1  # Assistant turns per episode (>1 for tool use).
  config.env.max_tool_calls = 4  # Tool calls per episode before it is cut.
  # env.name='tool_longtail' (sao_jax/envs/longtail.py): task t's actions are
  # capped at longtail_min_tokens * 2**j, j geometric in [0, longtail_levels).
  config.env.longtail_min_tokens = 8
  config.env.longtail_levels = 5
  # ... and, if longtail_tool_calls > 0, task t's first k actions are tool
  # calls answered after longtail_tool_latency_s, k geometric in
  # [0, longtail_tool_calls]; its actions then end at their length.
  config.env.longtail_tool_calls = 0
  config.env.longtail_tool_latency_s = 0.0
  # Longest one env reset/step may take; longer ends the episode as an ERROR
  # row (counted, never trained on) while the other episodes go on.
  config.env.step_timeout_s = 60.0
  # env.name='code' (sao_jax/envs/code_env.py): sandboxed Python calls.
  # Mechanism: 'auto' (bwrap, else refuse), 'bwrap', 'landlock' (the
  # weaker fallback, only by name) or 'unsafe_subprocess' (no isolation;
  # docs/design/sandbox.md "Code sandbox").
  config.env.code_sandbox = "auto"
  config.env.code_mode = "warm"  # 'warm' (forked per call) or 'strict'.
  config.env.code_workers = 2  # Sandboxes per process (concurrent calls).
  config.env.code_preload = ()  # Modules warm sandboxes import once.
  config.env.code_wall_s = 5.0  # Per call; + 3 s must fit step_timeout_s.
  config.env.code_memory_mb = 512  # Per process (RLIMIT_AS).
  config.env.code_total_memory_mb = 1024  # Per sandbox (cgroup; 0: none).
  config.env.code_processes = 32  # Processes per sandbox.
  config.env.code_observation_chars = 512  # Tool result cut here.
  # Reward = r_quality * r_style in {0, 1}; the evolving env switches the
  # required answer style at these policy versions (docs/design/envs.md
  # "Online-learning simulation"). ('plain', 'boxed', 'answer_tag';
  # sao_jax.envs.evolving.STYLES).
  config.env.styles = ("plain", "boxed", "answer_tag")
  config.env.style_change_steps = (100, 200)

  # -------------------------------------------------------------- sampler ---
  config.sampler = ml_collections.ConfigDict()
  config.sampler.temperature = 1.0
  config.sampler.top_p = 1.0  # 1 disables nucleus truncation.
  config.sampler.top_k = 0  # 0 disables top-k truncation.
  # Lengths: 0 = derived from the task's measured prompts and answers; an
  # explicit value is checked against the same measurement (docs/design/envs.md
  # "Settings that follow the task"; also train.max_seq_len, sft_max_len).
  config.sampler.max_new_tokens = 64  # Per assistant turn.
  config.sampler.max_total_tokens = 256  # Whole trajectory, prompt included.
  # Prompts and observations are left-padded to powers of two >= this.
  config.sampler.min_prompt_bucket = 8
  config.sampler.batch_size = 16  # Episodes decoded together.
  # The rollout engine behind the sampler's Rollout interface
  # (sao_jax/sampler/interface.py; README "Rollout engines"): 'native' (our
  # JAX decoder, every backend) or 'vllm' (the vllm extra).
  config.sampler.engine = "native"
  # vLLM only: torch.compile its model (vLLM's default); False runs it eager
  # (`enforce_eager`), which starts in seconds instead of compiling C++ kernels
  # on a CPU (tests, short runs).
  config.sampler.vllm_compile = True
  # vLLM on a GPU only: the share of the GPU's memory it may take (weights and
  # KV cache; `gpu_memory_utilization`), in (0, 1). The trainer's JAX process
  # shares the chip, so less than vLLM's own 0.9. Unused on a CPU (its KV cache
  # is VLLM_CPU_KVCACHE_SPACE).
  config.sampler.vllm_gpu_memory = 0.35
  # Continuous batching (sao_jax/sampler/engine.py): episodes in flight (0:
  # batch_size); a finished episode's slot takes the next prompt at once
  # (refill=False: the slots start together when all are free, the batch
  # leaves with its slowest episode).
  config.sampler.num_slots = 0
  config.sampler.refill = True
  config.sampler.decode_chunk = 16  # Tokens per jitted decode call.
  # Only the rows with work run the model (padded to 1/8, 1/4 or 1/2 of the
  # slots: more shapes to compile); False: every call runs all slots, masked
  # (cheaper overall when a full-batch forward is cheap, as for tiny models).
  config.sampler.row_subsets = True
  # The most rows one call feeds prompts or observations to (0: no limit):
  # below the slots, rows are prefilled that many a call, bounding the
  # prefill's activations (Qwen2.5-7B's 64 slots of 4,096 prompt tokens at
  # once need 122 GB of temporaries a chip; `python -m sao_jax.aot` compiles
  # the prefill as the sampler then runs it).
  config.sampler.prefill_rows = 0
  # Adopt newer weights every this many decoded tokens, in flight (0: only
  # with no episode in flight); the KV cache of in-flight episodes is 'keep'
  # (PipelineRL) or 'recompute' (AReaL) at a swap.
  config.sampler.weight_poll_tokens = 32
  config.sampler.kv_on_swap = "keep"
  config.sampler.env_threads = 4  # env.step calls run off the decode loop.
  config.sampler.n_rollouts = 1  # SAO: one rollout per prompt (>1: groups).
  # CPU cores / local devices the sampler process uses ('' = JAX default).
  config.sampler.devices = ""
  # Accelerators of the sampler's own (docs/design/pods.md "Processes and
  # chips"): 'gpu:IDS' (it sees those GPUs, the trainer the rest) or 'SLICE:IDS'
  # ('v5e-8:4-7': on each host of that TPU slice the sampler takes those chips);
  # '' = no split.
  config.sampler.chips = ""
  # The native sampler's mesh over its devices (sao_jax/sampler/mesh.py;
  # docs/design/pods.md "The sampler's mesh"): data replicas, the expert
  # axis (MoE experts) and tensor parallel (heads, KV heads, MLP, vocab);
  # one size may be -1 (the rest of the sampler's devices). tensor 0: auto,
  # tensor parallel over the sampler's whole block where sampler.chips gives
  # it one, else one device (1, 1, 1).
  config.sampler.mesh = ml_collections.ConfigDict()
  config.sampler.mesh.data = 1
  config.sampler.mesh.expert = 1
  config.sampler.mesh.tensor = 0
  # JAX's persistent compilation cache for the sampler process ('' = off):
  # its decode shapes compile once per machine instead of once per run.
  config.sampler.compilation_cache_dir = ""
  # The dtype of the sampler's copy of the policy ('' = model.dtype, the
  # compute dtype): the weight slot and every publish carry it, the trainer
  # keeps model.param_dtype master weights (sao_jax/sampler/precision.py).
  config.sampler.param_dtype = ""
  # Sampler restarts (sao_jax/sampler/supervisor.py): when the sampler process
  # dies the trainer starts a new one at the consumed-episodes watermark, at
  # most max_restarts times per trainer process and max_restarts_per_window
  # times within any restart_window_s seconds (0: no window bound); then the
  # run stops with the sampler's error. max_restarts=0: the first death ends it.
  config.sampler.max_restarts = 10
  config.sampler.restart_window_s = 600.0
  config.sampler.max_restarts_per_window = 3

  # ------------------------------------------------------------------- rl ---
  config.rl = ml_collections.ConfigDict()
  config.rl.loss = "sao"  # Name in sao_jax.rl.registry.
  # Clip / DIS band: None = the registered loss's default (SAO's DIS band
  # 1 - 0.3 < r < 1 + 5.0, Eqs. 1-3; GRPO's clip-higher 0.2 / 0.28; ...).
  config.rl.eps_low = config_dict.placeholder(float)
  config.rl.eps_high = config_dict.placeholder(float)
  config.rl.kl_coef = 0.0  # k3 KL to the reference policy (PPO/GRPO).
  # Extra per-algorithm hyper-parameters; None = the registry's default.
  config.rl.dual_clip = config_dict.placeholder(float)
  config.rl.cap = config_dict.placeholder(float)
  config.rl.mismatch_low = config_dict.placeholder(float)
  config.rl.mismatch_high = config_dict.placeholder(float)
  config.rl.behav_weight_cap = config_dict.placeholder(float)
  config.rl.constant = config_dict.placeholder(float)
  # Advantage estimator (advantages.ESTIMATORS); None = the one the loss is
  # registered with (sao: 'decoupled_gae', skip-observation GAE, lam_critic
  # for targets, length-adaptive policy lambda). Others: 'gae' (one lambda =
  # lam_critic), 'vapo_gae', 'group_zscore', 'group_mean', 'rloo',
  # 'batch_whiten', 'running_mean'.
  config.rl.advantage = config_dict.placeholder(str)
  config.rl.gamma = 1.0
  config.rl.lam_critic = 1.0  # lambda for value targets.
  # Policy lambda = 1 - 1 / (alpha * l), l = action tokens (length-adaptive).
  config.rl.lam_policy_alpha = 1.5
  config.rl.running_mean_k = 8  # Rewards kept per prompt (running_mean).
  # 'prompt': baseline = mean of the prompt's last k rewards; 'global': of
  # the last k rewards of any prompt (the online simulation's baseline).
  config.rl.running_mean_scope = "prompt"
  config.rl.critic_warmup_steps = 10  # Critic-only steps before the policy.
  config.rl.critic_updates_per_step = 2  # Critic steps per policy step.
  config.rl.critic_frozen_attention = True  # Train only MLP + head.
  # The critic's value-head kernel ~N(0, std) (0: zeros, so V starts at the
  # bias, 0, a constant baseline); its backbone is the policy's.
  config.rl.value_head_init_std = 0.02
  config.rl.value_clip = config_dict.placeholder(float)  # None: plain MSE.

  # ---------------------------------------------------------------- optim ---
  config.optim = ml_collections.ConfigDict()
  config.optim.actor_lr = 1e-6
  config.optim.critic_lr = 5e-6
  config.optim.warmup_steps = 0
  config.optim.schedule = "constant"  # 'constant' | 'cosine'.
  config.optim.weight_decay = 0.0  # Decoupled (AdamW) weight decay.
  config.optim.b1 = 0.9  # Adam beta1.
  config.optim.b2 = 0.999  # Adam beta2.
  config.optim.eps = 1e-8  # Adam epsilon.
  config.optim.grad_clip = 1.0  # Global norm; 0 disables.

  # ---------------------------------------------------------------- train ---
  config.train = ml_collections.ConfigDict()
  # 'async' (SAO), 'sync' (generate then train, staleness 0), 'group'
  # (sync with n_rollouts > 1 for group baselines) or 'replay' (the trainer
  # alone on the stream recorded in train.replay_from; README "Record and
  # replay").
  config.train.mode = "async"
  config.train.num_steps = 200  # Policy optimizer steps.
  config.train.batch_size = 16  # Trajectories per step (global).
  config.train.max_seq_len = 256  # Padded length of a training row.
  # Sequence packing (docs/design/data_path.md "Packed rows"): each of the
  # batch_size rows holds up to pack_max_segments trajectories back to back,
  # so batch_size then counts rows, not trajectories ('async' mode only).
  config.train.pack = False
  config.train.pack_max_segments = 8
  config.train.max_staleness = 4  # eta: policy versions a trajectory may lag.
  config.train.publish_every = 1  # Publish weights to the sampler every n.
  # Weight-publication holdback (staleness studies): the sampler gets the
  # weights of version v - publish_lag instead of v, and may run ahead only
  # max_staleness - publish_lag steps, which forces staleness ~= publish_lag
  # whatever the speeds of the two processes. 0 = publish the newest.
  config.train.publish_lag = 0
  # Stop once the trainer has read this many generated action tokens (equal
  # token budgets across algorithms); 0 = run num_steps.
  config.train.max_generated_tokens = 0
  # Stop after the step that ends past this many wall seconds since the
  # trainer started (job time limits); final eval and summary still run.
  # 0 = no limit.
  config.train.max_train_s = 0.0
  config.train.eval_every = 50  # Policy steps between evals; 0 = never.
  # Held-out episodes decoded together (their KV cache: long tasks on a
  # small machine want fewer).
  config.train.eval_batch_size = 64
  config.train.checkpoint_every = 100  # Steps between checkpoints; 0 = never.
  config.train.log_every = 10  # Steps between TensorBoard writes.
  config.train.seed = 0  # Init and sampling PRNG seed.
  # A step with non-finite losses, gradient norms or parameters is skipped
  # (nothing changes); this many skips in a row stop the run with an error.
  config.train.max_skipped_steps = 3
  # More than this share of ERROR trajectories (env raised or timed out)
  # among the last 4 batches' stops the run; ERROR rows are never trained on.
  config.train.max_error_frac = 0.5
  # Record every trajectory the trainer reads (with its step, staleness and
  # whether it was dropped as stale) to workdir/stream, one ArrayRecord shard
  # per record_shard_steps steps (and per checkpoint).
  config.train.record_stream = False
  config.train.record_shard_steps = 100
  # mode='replay': the workdir of the recorded run, and the steps [a, b) to
  # replay (() = all recorded); a replay starts from that run's newest
  # checkpoint at or before a.
  config.train.replay_from = ""
  config.train.replay_steps = ()
  # Supervised warm start on task solutions before RL (0 = none).
  config.train.sft_steps = 0
  config.train.sft_batch_size = 64
  config.train.sft_lr = 3e-3
  config.train.sft_max_len = 64
  # Share of SFT demonstrations that call the calculator tool before
  # answering (env 'tool'); the rest answer directly.
  config.train.sft_tool_frac = 0.0
  config.train.sft_seed = 0  # Init + data order of the SFT warm start.
  # SFT demonstrations: None = the first RL training tasks; an int = problems
  # of their own item seeds [sft_data_seed, +4096), disjoint from RL's.
  config.train.sft_data_seed = config_dict.placeholder(int)
  # Directory shared by runs to cache SFT warm starts (keyed by a hash of
  # everything they depend on), e.g. one per sweep; '' = workdir/sft.
  config.train.sft_cache_dir = ""

  # ----------------------------------------------------------------- mesh ---
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1  # Data-parallel replicas.
  config.mesh.fsdp = -1  # FSDP shards; -1: all remaining devices.
  config.mesh.tensor = 1  # Tensor (Megatron) parallel size.
  # Logical axis -> mesh axes (None = replicate), highest priority first.
  # Default: batch over data x fsdp, 'embed' over fsdp, vocab/mlp/heads over
  # tensor (see sao_jax.sharding.DEFAULT_RULES for the table).
  config.mesh.rules = sharding.DEFAULT_RULES

  # ----------------------------------------------------------------- ring ---
  config.ring = ml_collections.ConfigDict()
  config.ring.capacity_bytes = 64 * 2**20  # Trajectory ring shared memory.
  config.ring.put_timeout_s = 60.0  # Sampler waits this long for free space.
  # The trainer waits for a trajectory this long for the sampler's generation
  # (and start-up), plus its env calls' bound (env.step_timeout_s each):
  # sampler.rollout.data_wait_s.
  config.ring.get_timeout_s = 600.0

  # ---------------------------------------------------------- distributed ---
  # Multi-host: one trainer + one sampler per host. None = from the
  # environment (JAX_COORDINATOR_ADDRESS, ...); one process = no-op.
  config.distributed = ml_collections.ConfigDict()
  config.distributed.coordinator_address = config_dict.placeholder(str)
  config.distributed.num_processes = config_dict.placeholder(int)
  config.distributed.process_id = config_dict.placeholder(int)
  config.distributed.cpu_collectives = "gloo"  # CPU cross-process backend.
  config.distributed.auto_detect = False  # Let JAX find TPU pod / SLURM.

  return config
