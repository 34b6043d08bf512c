"""Create models/tiny-llama/: a tiny Llama config plus a locally trained tokenizer.

The vLLM CPU worker serves this folder with ``--load-format dummy`` (random weights), so no
weights are written: only the config, the tokenizer and a chat template. Nothing is downloaded;
the tokenizer's training text is generated here from a fixed seed, so every run writes the same
bytes (the files are committed and should not churn).

Run with the worker venv's interpreter, which has ``tokenizers`` and ``transformers``::

    .venv-worker/bin/python scripts/make_tiny_model.py [--out models/tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "tiny-llama"

VOCAB_SIZE = 2000
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Role markers are added tokens so the chat template never splits them into byte pieces.
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# A plain template: each turn is "<|role|>\n{content}</s>\n"; generation continues after
# "<|assistant|>\n". Content given as a list of parts (OpenAI style) is joined by its texts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in for on with at by from up about into over after gateway worker request "
    "token tokens stream streaming latency throughput goodput deadline queue batch batching "
    "model server client response prompt completion chat message system user assistant "
    "hello world please tell me explain why how what when where which who is are was were be "
    "been have has had do does did can could will would should may might must shall time "
    "first last next fast slow small large tiny quick brown fox jumps lazy dog cat bird tree "
    "river mountain city road house garden book paper story poem song music number one two "
    "three four five six seven eight nine ten hundred thousand million data memory cache "
    "kernel thread core process engine schedule scheduler priority tier limit rate second "
    "minute hour day week year good bad new old great little long short high low right left "
    "open close start stop run wait send receive read write load save make build test check "
    "python rust json http header body status error retry timeout cancel disconnect metric"
)
_WORDS = _WORD_TEXT.split()


def training_text(seed: int = 0, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English lines, with punctuation, digits and some code."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":", ";"])
        if i % 7 == 0:
            sentence += f" {rng.randint(0, 99999)} {rng.random():.3f}"
        if i % 11 == 0:
            sentence = f'{{"{words[0]}": [{rng.randint(0, 9)}, "{words[-1]}"]}}'
        if i % 13 == 0:
            sentence = f"def {words[0]}_{words[1]}(x):\n    return x + {rng.randint(1, 9)}"
        out.append(sentence)
    return out


def build_tokenizer() -> Tokenizer:
    """Train a byte-level BPE tokenizer of about VOCAB_SIZE entries on the generated text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama, prepend BOS when special tokens are requested (the completions endpoint does;
    # vLLM renders chat with add_special_tokens=False, and the template writes BOS itself).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok


def write_model(out: Path) -> None:
    """Write config.json, generation_config.json and the tokenizer files into ``out``."""
    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    vocab = len(fast)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        fast.save_pretrained(tmp)
        # Written by hand rather than via LlamaConfig.save_pretrained: that file would carry the
        # transformers version and dozens of generic defaults (churn on every upgrade). The
        # script checks below that LlamaConfig reads it back as intended.
        config_dict: dict[str, object] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": fast.bos_token_id,
            "eos_token_id": fast.eos_token_id,
            "pad_token_id": fast.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        generation = {
            "bos_token_id": fast.bos_token_id,
            "eos_token_id": fast.eos_token_id,
            "pad_token_id": fast.pad_token_id,
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_length": 1024,
        }
        (tmp / "generation_config.json").write_text(
            json.dumps(generation, indent=2, sort_keys=True) + "\n"
        )
        # The chat template is kept inside tokenizer_config.json only; newer transformers may
        # also write chat_template.jinja, which would be a second copy to keep in sync.
        tcfg_path = tmp / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text())
        tcfg["chat_template"] = CHAT_TEMPLATE
        # transformers 5 writes its own class name and key; the classic ones load in both 4.x
        # and 5.x, so tools with an older transformers (benchmark clients) can read it too.
        tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tcfg.pop("backend", None)
        tcfg["additional_special_tokens"] = tcfg.pop("extra_special_tokens", ROLE_TOKENS)
        tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
        (tmp / "chat_template.jinja").unlink(missing_ok=True)

        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, out)


def check(out: Path) -> None:
    """Read the folder back the way vLLM does and fail loudly if anything is off."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(config, LlamaConfig), type(config)
    assert config.vocab_size == len(tok), (config.vocab_size, len(tok))
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = "<s><|system|>\nBe brief.</s>\n<|user|>\nHello world</s>\n<|assistant|>\n"
    assert prompt == expected, prompt
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    for marker in ROLE_TOKENS:  # each role marker must stay one token
        assert tok.convert_tokens_to_ids(marker) in ids, marker
    assert tok.decode(ids) == prompt
    assert tok("hi")["input_ids"][0] == tok.bos_token_id


def main() -> None:
    """Command-line entry: write the tiny model folder and list what was written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    out: Path = args.out
    write_model(out)
    check(out)
    for path in sorted(out.iterdir()):
        print(
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
            f"  {path.stat().st_size} bytes"
        )


if __name__ == "__main__":
    main()
