"""Every flag of ms-swift's Megatron GRPO arguments, and what `megatron rlhf` does with it.

A script ported from `swift megatron rlhf` must not stop at "unknown option" nor have a
flag silently dropped: each ms-swift flag here is either an option of ours (groups.py,
or an alias), or rejected in the collected error with the feature it belongs to:

    --moe_enable_deepep is an ms-swift option not supported yet: MoE kernels and router variants (DeepEP,
    shared-expert overlap, expert bias)

MS_SWIFT_FLAGS lists the names by the ms-swift argument class that declares them
(`swift megatron rlhf` parses MegatronRLHFArguments; its bases are listed in MRO order),
read from modelscope/ms-swift's source (swift/megatron/arguments/*.py and
swift/arguments/**, commit 3602360a, 2026-08); LEGACY_FLAGS holds the names of ms-swift
3.x (Megatron-LM spellings) that v4 dropped but older scripts still carry.
`tools/ms_swift_flags.py` regenerates docs/ms-swift.md from this module and, given an
ms-swift checkout, lists the flags it has that this module does not know.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

MS_SWIFT_REVISION = "3602360a562313afbf2ef6065fdf61f271a2c5b9"


def _names(text: str) -> Tuple[str, ...]:
    return tuple(text.split())


MS_SWIFT_FLAGS: Dict[str, Tuple[str, ...]] = {k: _names(v) for k, v in {
    "MegatronRLHFArguments": """
        rlhf_type loss_scale truncation_strategy calculate_per_token_loss
    """,
    "MegatronSftArguments": """
        add_version create_checkpoint_symlink load_args
    """,
    "MegatronBaseArguments": """
        skip_megatron_init
    """,
    "MegatronArguments": """
        micro_batch_size global_batch_size recompute_granularity recompute_method
        recompute_num_layers recompute_modules train_iters num_train_epochs
        masked_softmax_fusion bias_dropout_fusion bias_activation_fusion apply_rope_fusion
        gradient_accumulation_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl
        attention_backend optimizer optimizer_cpu_offload optimizer_offload_fraction
        optimizer_cuda_graph use_precision_aware_optimizer main_grads_dtype
        main_params_dtype exp_avg_dtype exp_avg_sq_dtype manual_gc manual_gc_steps
        manual_gc_eval seed train_dataloader_shuffle dataloader_num_workers
        dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor
        data_sharding group_by_length te_rng_tracker data_parallel_random_init padding_free
        mlp_padding_free lr_warmup_init lr lr_decay_style lr_decay_iters lr_warmup_iters
        lr_warmup_fraction min_lr lr_wsd_decay_style lr_wsd_decay_iters weight_decay
        weight_decay_incr_style start_weight_decay end_weight_decay clip_grad adam_beta1
        adam_beta2 adam_eps sgd_momentum muon_momentum muon_split_qkv muon_use_nesterov
        muon_scale_mode muon_fp32_matmul_prec muon_coefficient_type muon_num_ns_steps
        muon_tp_mode muon_extra_scale_factor muon_scalar_optimizer output_dir save_steps
        no_save_optim no_save_rng mcore_model mcore_adapter no_load_optim no_load_rng
        finetune perform_initialization use_cpu_initialization async_save save_total_limit
        metric_for_best_model greater_is_better use_persistent_ckpt_worker
        dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable
        distrib_optim_fully_reshardable_mem_efficient local_rank ddp_timeout ddp_backend
        use_distributed_optimizer use_megatron_fsdp data_parallel_sharding_strategy
        tensor_model_parallel_size pipeline_model_parallel_size
        decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
        overlap_p2p_comm batch_p2p_comm align_param_gather sequence_parallel
        context_parallel_size cp_comm_type cp_partition_mode sequence_packing_scheduler
        tp_comm_overlap overlap_grad_reduce overlap_param_gather
        overlap_param_gather_with_optimizer_step align_grad_reduce nccl_comm_warmup
        virtual_pipeline_model_parallel_size microbatch_group_size_per_vp_stage
        pipeline_model_parallel_layout expert_model_parallel_size
        expert_tensor_parallel_size report_to logging_steps tensorboard_dir
        tensorboard_queue_size wandb_project wandb_exp_name swanlab_project swanlab_exp_name
        eval_iters eval_steps fp8_format fp8_recipe fp8_param_gather fp8_amax_history_len
        fp8_amax_compute_algo fp4_format fp4_recipe fp4_param_gather fp16 bf16
        apply_query_key_layer_scaling attention_softmax_in_fp32
        accumulate_allreduce_grads_in_fp32 moe_router_load_balancing_type moe_router_dtype
        moe_token_dispatcher_type moe_enable_deepep moe_grouped_gemm moe_permute_fusion
        moe_aux_loss_coeff moe_z_loss_coeff moe_shared_expert_overlap moe_layer_recompute
        moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_token_drop_policy
        mtp_num_layers mtp_loss_scaling_factor mtp_decoder_input_detach mtp_shared_weights
        bridge_backend model model_type save_safetensors save_missing_weights adapters
        ref_model ref_adapters use_hf hub_token merge_lora max_shard_size
        vit_gradient_checkpointing vit_gradient_checkpointing_kwargs vit_attn_impl vit_lr
        aligner_lr dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
        apply_dsa_kernel_fusion csa_dense_mode use_fused_mhc mhc_recompute_layer_num
        megatron_extra_kwargs language_model_only check_model torch_dtype rope_scaling
        apply_wd_to_qk_layernorm linear_decoupled_in_proj enable_dft_loss
        enable_channel_loss task_type num_labels problem_type mrl_dims save_strategy
        callbacks
    """,
    "RLHFMegatronArgumentsMixin": """
        loss_type mcore_ref_model mcore_ref_adapter beta rpo_alpha reference_free
        label_smoothing f_divergence_type desirable_weight undesirable_weight calculate_KL
        center_rewards_coefficient teacher_model teacher_model_type teacher_model_revision
        teacher_model_server teacher_tag_key gkd_logits_topk lmbda seq_kd
        offload_teacher_model sft_alpha teacher_kl_coef temperature generation_batch_size
        steps_per_generation num_generations num_generations_eval max_completion_length
        importance_sampling_level tau_pos tau_neg real_tau fipo_decay_rate fipo_clip_range
        fipo_clip_high_only fipo_safety_threshold epsilon epsilon_high delta top_k top_p
        repetition_penalty use_vllm use_ray vllm_mode vllm_enable_prefix_caching
        vllm_gpu_memory_utilization vllm_tensor_parallel_size vllm_max_model_len
        vllm_enforce_eager vllm_limit_mm_per_prompt vllm_disable_cascade_attn
        vllm_max_num_seqs vllm_mm_processor_cache_gb vllm_engine_kwargs vllm_enable_lora
        sleep_level offload_optimizer offload_model offload_bridge vllm_server_base_url
        vllm_server_host vllm_server_port vllm_server_timeout vllm_server_group_port
        reward_funcs reward_weights cosine_min_len_value_wrong cosine_max_len_value_wrong
        cosine_min_len_value_correct cosine_max_len_value_correct cosine_max_len
        repetition_n_grams repetition_max_penalty soft_max_length soft_cache_length
        dynamic_sample max_resample_times overlong_filter scale_rewards advantage_estimator
        kl_in_reward wandb_log_unique_prompts log_completions
        rollout_importance_sampling_mode rollout_importance_sampling_threshold
        log_rollout_offpolicy_metrics off_policy_sequence_mask_delta log_entropy
        top_entropy_quantile router_replay_mode reward_model reward_model_plugin
        sync_ref_model ref_model_sync_steps ref_model_mixup_alpha async_generate
        move_model_batches multi_turn_scheduler max_turns completion_length_limit_scope
        vllm_server_pass_dataset use_gym_env gym_env num_iterations dataset_shuffle
    """,
    "MegatronTunerMixin": """
        tuner_type freeze_llm freeze_vit freeze_aligner freeze_parameters
        freeze_parameters_regex freeze_parameters_ratio trainable_parameters
        trainable_parameters_regex target_modules target_regex modules_to_save lora_rank
        lora_alpha lora_dropout lora_bias lora_dtype use_rslora
    """,
    "BaseArguments": """
        tuner_backend external_plugins custom_register_path model_kwargs
        enable_npu_model_patch load_data_args packing packing_length packing_num_proc
        packing_strategy lazy_tokenize ignore_args_error use_swift_lora
    """,
    "GenerationArguments": """
        max_new_tokens num_beams stream stop_words logprobs top_logprobs
        structured_outputs_regex
    """,
    "QuantizeArguments": """
        quant_method quant_bits hqq_axis bnb_4bit_compute_dtype bnb_4bit_quant_type
        bnb_4bit_use_double_quant bnb_4bit_quant_storage
    """,
    "DataArguments": """
        dataset val_dataset cached_dataset cached_val_dataset split_dataset_ratio data_seed
        dataset_num_proc load_from_cache_file val_dataset_shuffle streaming interleave_prob
        stopping_strategy shuffle_buffer_size download_mode columns strict
        remove_unused_columns disable_auto_column_mapping model_name model_author
        custom_dataset_info
    """,
    "TemplateArguments": """
        template system max_length max_pixels agent_template norm_bbox use_chat_template
        padding_side sequence_parallel_size is_binary_loss_scale template_backend
        response_prefix enable_thinking preserve_thinking add_non_thinking_prefix
        disable_ignore_empty_think
    """,
    "ModelArguments": """
        model_revision attn_impl experts_impl new_special_tokens device_map max_memory
        max_model_len local_repo_path init_strategy
    """,
    "RayArguments": """
        ray_exp_name device_groups
    """,
}.items()}

# ms-swift 3.x (before the v4 refactor, d7c7db3a) spelled many options as Megatron-LM does.
LEGACY_FLAGS: Tuple[str, ...] = _names("""
    activation_func_clamp_value adapter_load add_qkv_bias attention_dropout
    auto_detect_ckpt_format ckpt_assume_constant_structure ckpt_format
    ckpt_fully_parallel_load dataloader_type deterministic_mode disable_bias_linear
    distributed_backend distributed_timeout_minutes eval_interval
    exit_on_missing_checkpoint ffn_hidden_size glu_linear_offset
    gradient_checkpointing_kwargs group_query_attention hf_model_type hidden_dropout
    hidden_size initialize_embedding kv_channels kv_lora_rank layer_types
    linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads
    linear_num_value_heads linear_value_head_dim llm_model_type load load_safetensors
    log_interval log_memory_to_tensorboard log_params_norm log_throughput
    log_timers_to_tensorboard log_validation_ppl_to_tensorboard logging_level
    manual_gc_interval max_epochs max_position_embeddings
    microbatch_group_size_per_virtual_pipeline_stage moe_apply_probs_on_input
    moe_ffn_hidden_size moe_layer_freq moe_router_bias_update_rate
    moe_router_enable_expert_bias moe_router_group_topk moe_router_num_groups
    moe_router_pre_softmax moe_router_score_function moe_router_topk
    moe_router_topk_scaling_factor moe_shared_expert_intermediate_size mrope_interleaved
    mrope_section multi_latent_attention no_bias_dropout_fusion no_bias_swiglu_fusion
    no_data_sharding no_gradient_accumulation_fusion no_initialization
    no_log_learning_rate_to_tensorboard no_masked_softmax_fusion no_rope_freq
    no_rope_fusion norm_epsilon normalization num_attention_heads num_experts num_layers
    num_layers_per_virtual_pipeline_stage num_query_groups
    num_virtual_stages_per_pipeline_rank num_workers original_max_position_embeddings
    padded_vocab_size partial_rotary_factor position_embedding_type q_lora_rank
    qk_head_dim qk_l2_norm qk_layernorm qk_pos_emb_head_dim quick_geglu ref_adapter_load
    ref_load rotary_base rotary_interleaved rotary_percent save save_interval
    save_retain_interval seq_length softmax_type swiglu tensorboard_log_interval
    train_type transformer_impl untie_embeddings_and_output_weights use_flash_attn
    use_shared_expert_gate v_head_dim wandb_save_dir window_attn_skip_freq window_size
""")

# Flags not supported yet, by the feature they belong to.
UNSUPPORTED: Dict[str, Tuple[str, ...]] = {k: _names(v) for k, v in {
    "LoRA variants (mcore adapters, target_regex, LoRA bias and dtype, tuner backends)": """
        mcore_adapter mcore_ref_adapter target_regex lora_bias lora_dtype
        tuner_backend use_swift_lora adapter_load ref_adapter_load
    """,
    "MoE kernels and router variants (DeepEP, shared-expert overlap, expert bias)": """
        moe_enable_deepep moe_shared_expert_overlap
        experts_impl moe_apply_probs_on_input moe_router_bias_update_rate
        moe_router_enable_expert_bias
    """,
    "MoE architecture, read from the model's config.json (num_experts, num_experts_per_tok, "
    "moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size)": """
        moe_ffn_hidden_size moe_layer_freq moe_router_group_topk moe_router_num_groups
        moe_router_pre_softmax moe_router_score_function moe_router_topk
        moe_router_topk_scaling_factor moe_shared_expert_intermediate_size num_experts
        use_shared_expert_gate
    """,
    "agent templates (multi-turn rollouts use the chat template)": """
        agent_template
    """,
    "vision-language tuning options (ViT learning rate and recompute, mrope overrides, bbox normalisation)": """
        vit_gradient_checkpointing vit_gradient_checkpointing_kwargs
        vit_attn_impl vit_lr aligner_lr norm_bbox vllm_mm_processor_cache_gb
        language_model_only mrope_interleaved mrope_section
    """,
    "packing samples into fixed-length bins across the dataset (--padding_free true packs "
    "each micro-batch)": """
        packing packing_length packing_num_proc packing_strategy sequence_packing_scheduler
    """,
    "padding-free MLP of padded batches (--padding_free true removes the padding "
    "everywhere)": "mlp_padding_free",
    "best-checkpoint selection and validation perplexity (evaluation logs eval/* rewards)": """
        metric_for_best_model greater_is_better log_validation_ppl_to_tensorboard
    """,
    "other RLHF types (dpo, kto, rm, gkd); only grpo is implemented": """
        rpo_alpha reference_free label_smoothing f_divergence_type desirable_weight
        undesirable_weight calculate_KL center_rewards_coefficient gkd_logits_topk lmbda
        seq_kd sft_alpha
    """,
    "on-policy distillation from a hub teacher (--teacher_model takes a local folder)": """
        teacher_model_type teacher_model_revision
    """,
    "reference model sync (TR-DPO style)": "sync_ref_model ref_model_sync_steps ref_model_mixup_alpha",
    "asynchronous generation": "async_generate",
    "a reference model from a Megatron checkpoint (--ref_model takes an HF folder)":
        "mcore_ref_model ref_load",
    "starting from a Megatron checkpoint (pass the HF folder as --model; --resume continues a run)": """
        mcore_model load auto_detect_ckpt_format exit_on_missing_checkpoint
    """,
    "Ray": "use_ray ray_exp_name device_groups skip_megatron_init",
    "checkpoint options": """
        no_load_optim no_load_rng async_save use_persistent_ckpt_worker
        dist_ckpt_save_pre_mcore_014 save_strategy create_checkpoint_symlink
        add_version load_args save_missing_weights max_shard_size ckpt_format
        ckpt_assume_constant_structure ckpt_fully_parallel_load save_retain_interval
    """,
    "optimizers other than Adam": """
        optimizer sgd_momentum muon_momentum muon_split_qkv muon_use_nesterov muon_scale_mode
        muon_fp32_matmul_prec muon_coefficient_type muon_num_ns_steps muon_tp_mode
        muon_extra_scale_factor muon_scalar_optimizer
    """,
    "optimizer CPU offload and precision-aware optimizer": """
        optimizer_cpu_offload optimizer_offload_fraction optimizer_cuda_graph
        use_precision_aware_optimizer main_grads_dtype main_params_dtype exp_avg_dtype
        exp_avg_sq_dtype accumulate_allreduce_grads_in_fp32
    """,
    "learning-rate and weight-decay schedules beyond cosine/linear/constant": """
        lr_warmup_init lr_wsd_decay_style lr_wsd_decay_iters weight_decay_incr_style
        start_weight_decay end_weight_decay
    """,
    "fp8/fp4 training": """
        fp8_format fp8_recipe fp8_param_gather fp8_amax_history_len fp8_amax_compute_algo
        fp4_format fp4_recipe fp4_param_gather
    """,
    "fp16 training (bf16 and fp32 are supported)": """
        fp16 apply_query_key_layer_scaling attention_softmax_in_fp32
    """,
    "quantized training": """
        quant_method quant_bits hqq_axis bnb_4bit_compute_dtype bnb_4bit_quant_type
        bnb_4bit_use_double_quant bnb_4bit_quant_storage
    """,
    "Megatron kernel fusions (GPU)": """
        masked_softmax_fusion bias_dropout_fusion bias_activation_fusion apply_rope_fusion
        gradient_accumulation_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl
        no_bias_dropout_fusion no_bias_swiglu_fusion no_gradient_accumulation_fusion
        no_masked_softmax_fusion no_rope_fusion quick_geglu
    """,
    "communication overlap (GPU)": """
        tp_comm_overlap overlap_grad_reduce overlap_param_gather
        overlap_param_gather_with_optimizer_step align_grad_reduce align_param_gather
        overlap_p2p_comm batch_p2p_comm nccl_comm_warmup
    """,
    "Megatron-FSDP": "use_megatron_fsdp data_parallel_sharding_strategy",
    "uneven pipeline splits and custom pipeline layouts": """
        decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
        pipeline_model_parallel_layout microbatch_group_size_per_vp_stage
        microbatch_group_size_per_virtual_pipeline_stage num_layers_per_virtual_pipeline_stage
    """,
    "context-parallel variants (one CP algorithm is implemented)": "cp_comm_type cp_partition_mode",
    "multi-token prediction (MTP)": """
        mtp_num_layers mtp_loss_scaling_factor mtp_decoder_input_detach mtp_shared_weights
    """,
    "DeepSeek sparse attention and DeepSeek-V4 layers": """
        dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss apply_dsa_kernel_fusion
        csa_dense_mode use_fused_mhc mhc_recompute_layer_num q_lora_rank kv_lora_rank
        qk_head_dim qk_pos_emb_head_dim v_head_dim multi_latent_attention
    """,
    "model architecture options (read from the model's config.json here)": """
        model_type rope_scaling model_kwargs megatron_extra_kwargs
        apply_wd_to_qk_layernorm linear_decoupled_in_proj bridge_backend
        init_strategy new_special_tokens max_model_len attn_impl model_revision
        local_repo_path device_map max_memory enable_npu_model_patch te_rng_tracker
        data_parallel_random_init perform_initialization use_cpu_initialization
        activation_func_clamp_value add_qkv_bias attention_dropout disable_bias_linear
        ffn_hidden_size glu_linear_offset group_query_attention hf_model_type hidden_dropout
        hidden_size initialize_embedding kv_channels layer_types linear_conv_kernel_dim
        linear_key_head_dim linear_num_key_heads linear_num_value_heads
        linear_value_head_dim llm_model_type max_position_embeddings no_initialization
        no_rope_freq norm_epsilon normalization num_attention_heads num_layers
        num_query_groups original_max_position_embeddings padded_vocab_size
        partial_rotary_factor position_embedding_type qk_l2_norm qk_layernorm rotary_base
        rotary_interleaved rotary_percent softmax_type swiglu transformer_impl
        untie_embeddings_and_output_weights window_attn_skip_freq window_size seq_length
        deterministic_mode
    """,
    "training tasks other than causal LM (SFT losses, embeddings, classifiers)": """
        task_type num_labels problem_type mrl_dims enable_dft_loss enable_channel_loss
        calculate_per_token_loss is_binary_loss_scale
    """,
    "hub downloads (models and datasets are local folders and files here)": """
        use_hf hub_token download_mode model_name model_author custom_dataset_info check_model
    """,
    "dataset options": """
        cached_dataset cached_val_dataset data_seed streaming interleave_prob stopping_strategy
        shuffle_buffer_size strict remove_unused_columns disable_auto_column_mapping
        lazy_tokenize load_data_args data_sharding no_data_sharding group_by_length
        train_dataloader_shuffle dataloader_type
    """,
    "chat template options (the tokenizer's own template is used)": """
        template template_backend use_chat_template response_prefix preserve_thinking
        add_non_thinking_prefix disable_ignore_empty_think padding_side
    """,
    "generation options of inference (GRPO sampling uses max_completion_length, "
    "temperature, top_p, top_k, repetition_penalty)": """
        max_new_tokens num_beams stream stop_words logprobs top_logprobs
        structured_outputs_regex
    """,
    "vLLM options": "vllm_disable_cascade_attn vllm_server_group_port",
    "logging options": """
        tensorboard_dir tensorboard_queue_size wandb_log_unique_prompts callbacks
        log_memory_to_tensorboard log_params_norm log_throughput log_timers_to_tensorboard
        no_log_learning_rate_to_tensorboard tensorboard_log_interval wandb_save_dir
        logging_level
    """,
    "ms-swift 3.x spellings replaced by other options (--attention_backend flash, "
    "--recompute_granularity)": "use_flash_attn gradient_checkpointing_kwargs",
    "manual garbage collection": "manual_gc manual_gc_steps manual_gc_eval manual_gc_interval",
    "launcher settings (set by torchrun and the platform layer here)": """
        local_rank ddp_timeout ddp_backend distributed_backend distributed_timeout_minutes
        sequence_parallel_size ignore_args_error
    """,
}.items()}

# Implemented on another branch (loss types, reward options); until it is merged they are
# rejected like UNSUPPORTED. Once the option exists in groups.py this entry is not consulted.
OTHER_BRANCH: Dict[str, str] = {}

# Options with ms-swift's meaning whose wiring into checkpoint.py is still to do (the lead);
# until then the parser reports them as unknown.
TO_WIRE: Tuple[str, ...] = ()

# ms-swift flags this project accepts although they change nothing here; why, for the doc.
ACCEPTED_WITHOUT_EFFECT: Dict[str, str] = {
    "dataset_num_proc": "prompts are read and rendered in the main process",
    "load_from_cache_file": "no preprocessing cache: prompts are read at start-up",
    "dataloader_num_workers": "no torch DataLoader: prompts are sampled by index",
    "dataloader_pin_memory": "no torch DataLoader: prompts are sampled by index",
    "dataloader_persistent_workers": "no torch DataLoader: prompts are sampled by index",
    "dataloader_prefetch_factor": "no torch DataLoader: prompts are sampled by index",
    "load_safetensors": "true only: weights are always read from --model's safetensors",
    "save_safetensors": "true only: final_hf/ is always written as safetensors",
    "vllm_server_pass_dataset": "the multi-turn scheduler runs in the trainer, server mode "
                                "too, and always sees each row's dataset columns",
}

# Rejected flags that switch on what this project does not do: their `false` is what runs
# here, so a script that spells it out (`--gradient_accumulation_fusion false`) is accepted.
OFF_HERE: Tuple[str, ...] = _names("""
    masked_softmax_fusion bias_dropout_fusion bias_activation_fusion apply_rope_fusion
    gradient_accumulation_fusion cross_entropy_loss_fusion optimizer_cpu_offload
    optimizer_cuda_graph use_precision_aware_optimizer manual_gc async_save tp_comm_overlap
    use_megatron_fsdp mlp_padding_free check_model async_generate sync_ref_model add_version
""")

# Choice values of implemented options that ms-swift accepts and this project does not (yet).
UNSUPPORTED_VALUES: Dict[Tuple[str, str], str] = {
    ("rlhf_type", "dpo"): "other RLHF types (dpo, kto, rm, gkd); only grpo is implemented",
    ("rlhf_type", "kto"): "other RLHF types (dpo, kto, rm, gkd); only grpo is implemented",
    ("rlhf_type", "rm"): "other RLHF types (dpo, kto, rm, gkd); only grpo is implemented",
    ("rlhf_type", "gkd"): "other RLHF types (dpo, kto, rm, gkd); only grpo is implemented",
    ("loss_scale", "all"): "loss scales other than masks of the model's messages",
    ("loss_scale", "ignore_empty_think"): "loss scales other than masks of the model's messages",
    ("moe_token_dispatcher_type", "flex"): "MoE: the flex dispatcher (DeepEP / HybridEP), GPU",
    ("moe_token_dispatcher_type", "allgather"):
        "MoE: Megatron's allgather dispatcher refuses variable sequence lengths",
    ("moe_router_load_balancing_type", "sinkhorn"): "MoE: sinkhorn load balancing",
    ("lr_decay_style", "WSD"): "learning-rate and weight-decay schedules beyond cosine/linear/constant",
    ("lr_decay_style", "inverse-square-root"):
        "learning-rate and weight-decay schedules beyond cosine/linear/constant",
    ("truncation_strategy", "right"): "ms-swift's GRPO allows only left and delete",
    ("truncation_strategy", "split"): "ms-swift's GRPO allows only left and delete",
}


def _feature_of() -> Dict[str, str]:
    table: Dict[str, str] = {}
    for feature, names in UNSUPPORTED.items():
        for name in names:
            if name in table:
                raise RuntimeError(f"{name} is listed under two features")
            table[name] = feature
    for name, feature in OTHER_BRANCH.items():
        table.setdefault(name, feature)
    return table


FEATURE_OF: Dict[str, str] = _feature_of()


def all_flags() -> Tuple[str, ...]:
    """Every ms-swift flag known here, current release first, then the 3.x names."""
    seen: Dict[str, None] = {}
    for names in MS_SWIFT_FLAGS.values():
        seen.update(dict.fromkeys(names))
    seen.update(dict.fromkeys(LEGACY_FLAGS))
    return tuple(seen)


def rejection(name: str) -> Optional[str]:
    """The one-line message for an ms-swift flag that is not supported yet, else None."""
    feature = FEATURE_OF.get(name)
    if feature is None:
        return None
    off = f"; --{name} false (what runs here) is accepted" if name in OFF_HERE else ""
    return f"--{name} is an ms-swift option not supported yet: {feature}{off}"
