"""The benchmarks' workload: Llama shapes from a transformers config, PEFT LoRA or QLoRA, HF checkpointing,
collectives count.

Shared by ``bench.py`` (stock vs fork) and ``peers.py`` (plain PyTorch, FSDP2, stock, fork).
"""

import contextlib

import torch

MODELS = {
    # Llama-3-8B shape.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    # TinyLlama-1.1B shape.
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# QLoRA's 4-bit weights are packed in bf16 elements (bnb_4bit_quant_storage), and its base checkpoint is bf16.
QUANT_STORAGE = torch.bfloat16


@contextlib.contextmanager
def _created_as(dtype, device):
    """Tensors created inside get ``dtype`` and ``device`` (no fp32 copy of a large model on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_name, ac, full, dtype, ds_config=None, device=None):
    """The model in ``dtype``, LoRA r16 on every linear layer unless ``full``, HF checkpointing as ``ac``.

    With ``ds_config``, created already partitioned (``zero.Init``); otherwise created on ``device``.
    PEFT keeps the adapters in fp32 (``autocast_adapter_dtype``); callers without a mixed-precision
    engine cast the whole model afterwards.
    """
    import deepspeed
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if ds_config:
        init = deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype)
    else:
        init = _created_as(dtype, device)
    with init:
        model = LlamaForCausalLM(LlamaConfig(**MODELS[model_name]))
    model = model.to(dtype)
    if ac != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ac == "reentrant"})
        if ac == "reentrant":
            model.enable_input_require_grads()
    if not full:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    return model


def save_random_base(model_name, directory, device=None):
    """QLoRA's base: the random-init ``model_name`` in bf16, created on ``device``, saved as a transformers checkpoint.

    The same seed as :func:`build_model`. Run it where torch.distributed is not initialized (``save_pretrained``
    writes on rank 0 only once it is).
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with _created_as(QUANT_STORAGE, device):
        model = LlamaForCausalLM(LlamaConfig(**MODELS[model_name]))
    model.save_pretrained(directory)


def build_qlora_model(directory, ac, compute_dtype, device):
    """The base in ``directory`` loaded in 4 bits on ``device`` (bitsandbytes NF4, bf16 storage, ``compute_dtype``),
    ``prepare_model_for_kbit_training`` (the params left unquantized in fp32), LoRA r16 on every linear layer,
    HF checkpointing as ``ac``. No ``zero.Init``: transformers never quantizes under it; a ZeRO-3 engine
    partitions the 4-bit weights when it is created (Note: [4-bit weights under ZeRO-3] in examples/qlora_lora.py).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=QUANT_STORAGE)
    model = LlamaForCausalLM.from_pretrained(directory, quantization_config=quantization, dtype=QUANT_STORAGE,
                                             device_map={"": device})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ac != "none",
                                            gradient_checkpointing_kwargs={"use_reentrant": ac == "reentrant"})
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))


def cast_unquantized(model, dtype):
    """Cast every floating param but the 4-bit weights to ``dtype``, in place (transformers refuses
    ``.to(dtype)`` on a quantized model; the packed weights must keep their storage dtype)."""
    from bitsandbytes.nn import Params4bit
    for param in model.parameters():
        if not isinstance(param, Params4bit) and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def zero3_config(device, mbs, dtype, zero_options=None):
    """The ZeRO-3 config of both benchmarks: clipping 1.0, bf16 when ``dtype`` is; on CPU every param partitioned."""
    zero = {"stage": 3, **(zero_options or {})}
    if device == "cpu":
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


class AllGatherCounter:
    """Calls and output bytes of every all-gather through ``torch.distributed``, once per outermost call.

    Wraps ``all_gather_into_tensor``, ``all_gather_single`` (what FSDP2 calls on recent torch),
    ``_all_gather_base`` and ``all_gather`` both on ``torch.distributed`` and in ``distributed_c10d``
    (where one delegates to another, only the outermost call counts). Install it before DeepSpeed
    initialises its backend: DeepSpeed keeps a reference to the all-gather function it finds then.
    """

    NAMES = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather")

    def __init__(self):
        import torch.distributed.distributed_c10d as c10d
        self.calls = 0
        self.bytes = 0
        self._depth = 0
        for name in self.NAMES:
            stock = getattr(c10d, name, None)
            if stock is None:
                continue
            wrapped = self._wrap(name, stock)
            setattr(c10d, name, wrapped)
            if getattr(torch.distributed, name, None) is stock:
                setattr(torch.distributed, name, wrapped)

    def _wrap(self, name, stock):
        def counted(*args, **kwargs):
            outermost = self._depth == 0
            self._depth += 1
            try:
                return stock(*args, **kwargs)
            finally:
                self._depth -= 1
                if outermost:
                    self.calls += 1
                    self.bytes += self._output_bytes(name, args, kwargs)

        counted.__wrapped__ = stock
        return counted

    @staticmethod
    def _output_bytes(name, args, kwargs):
        key = "tensor_list" if name == "all_gather" else "output_tensor"
        output = kwargs.get(key, args[0] if args else None)
        tensors = output if isinstance(output, (list, tuple)) else [output]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def take(self):
        """(calls, bytes) since the last take."""
        taken = (self.calls, self.bytes)
        self.calls = self.bytes = 0
        return taken
