"""Chat prompts (issue 8): messages are rendered with the checkpoint's own chat template exactly as
transformers' apply_chat_template renders and tokenizes them; demo models use a built-in template;
a model without a template refuses chat prompts."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.tokenizer import BYTE_CHAT_TEMPLATE, ChatTemplateError, load_tokenizer
from tests.demo_models import CLI_FLAGS, demo_model

# A Qwen3-style ChatML template: system prompt and tools, <think> reasoning kept only after the last
# user query, tool calls as JSON (tojson keeps non-ASCII text), tool responses folded into a user turn,
# enable_thinking=False writes an empty think block.
QWEN_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') }}
            {{- '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

# A Llama-2-style template: uses bos_token / eos_token and raise_exception.
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is 2 + 2?"}],
    "system and turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, über-quickly ☃"},
    ],
    "reasoning kept after the last query": [
        {"role": "user", "content": "Think first: 3 * 4?"},
        {"role": "assistant", "content": "<think>\n3 fours\n</think>\n\n12"},
        {"role": "user", "content": "And 5 * 5?"},
        {"role": "assistant", "reasoning_content": "five fives", "content": "25"},
    ],
    "tool call and response": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
    ],
}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """tokenizer.json (byte-level BPE with ChatML specials) + tokenizer_config.json with QWEN_TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[AddedToken(s, special=True) for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["user assistant system tool weather think the quick brown fox", "What is 2 + 2? Zürich 12 25"]
    tok.train_from_iterator(corpus * 40, trainer)
    d = tmp_path_factory.mktemp("chat_tok")
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN_TEMPLATE,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "model_max_length": 4096}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("<|im_end|>")]}))
    return d


def hf_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER_TOOL]}, {"enable_thinking": False}],
                         ids=["plain", "tools", "no-thinking"])
def test_rendering_and_ids_match_transformers(chat_dir, name, extra):
    messages = CONVERSATIONS[name]
    ours, theirs = load_tokenizer(chat_dir), hf_tokenizer(chat_dir)
    text = ours.apply_chat_template(messages, **extra)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **extra)
    assert ours.encode(text) == list(ids)
    assert ours.encode(text).count(ours._tok.token_to_id("<|im_start|>")) >= len(messages)  # specials are tokens
    no_prompt = ours.apply_chat_template(messages, add_generation_prompt=False, **extra)
    assert no_prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **extra)


def test_special_tokens_and_raise_exception_match_transformers(chat_dir, tmp_path):
    shutil.copy(chat_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": INST_TEMPLATE,
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(tmp_path), hf_tokenizer(tmp_path)
    good = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
    text = ours.apply_chat_template(good)
    assert text.startswith("<s>[INST] hi [/INST] hello</s>")
    assert text == theirs.apply_chat_template(good, tokenize=False, add_generation_prompt=True)
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="roles must alternate"):
        theirs.apply_chat_template(bad, tokenize=False)


def test_generation_blocks_render_like_transformers(chat_dir, tmp_path):
    """`{% generation %}` (transformers' assistant-mask marker) renders its body; loop controls work."""
    shutil.copy(chat_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    messages = CONVERSATIONS["system and turns"]
    text = load_tokenizer(tmp_path).apply_chat_template(messages)
    assert "You are terse" not in text and "<|im_start|>assistant\n7<|im_end|>" in text
    assert text == hf_tokenizer(tmp_path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_template_sources(chat_dir, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; the list form picks "default"; a
    checkpoint without either has no template; jaxspec's save keeps the template."""
    shutil.copy(chat_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_tokenizer(tmp_path).chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == QWEN_TEMPLATE
    saved = tmp_path / "saved"
    saved.mkdir()
    tok.save(saved)
    assert load_tokenizer(saved).chat_template == QWEN_TEMPLATE


def test_malformed_messages_and_templates_are_refused(chat_dir):
    tok = load_tokenizer(chat_dir)
    with pytest.raises(ChatTemplateError, match="needs a 'role' string"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="Unknown message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        jaxspec.tokenizer.render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])


# ---- generate and the CLI on the demo model ---------------------------------------------------------

def test_generate_accepts_chat_messages():
    """A conversation (or a list of them) generates exactly what its rendered text generates."""
    model = demo_model("qwen3")
    chat = [{"role": "user", "content": "hi"}]
    text = model.tokenizer.apply_chat_template(chat)
    assert text == "<|user|>\nhi\n<|assistant|>\n" and model.tokenizer.chat_template == BYTE_CHAT_TEMPLATE
    expected = jaxspec.generate(model, text, max_new_tokens=4).token_ids
    assert jaxspec.generate(model, chat, max_new_tokens=4).token_ids == expected
    other = [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}]
    both = jaxspec.generate(model, [chat, other], max_new_tokens=4).token_ids
    assert both[0] == expected[0]
    assert both[1] == jaxspec.generate(model, model.tokenizer.apply_chat_template(other), max_new_tokens=4).token_ids[0]


def test_model_without_chat_template_refuses_chat(chat_dir, tmp_path):
    shutil.copy(chat_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    model = dataclasses.replace(demo_model("qwen3"), tokenizer=load_tokenizer(tmp_path))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        jaxspec.generate(model, [{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_cli_chat_flag(capsys):
    assert cli.main(["generate", "--model", "demo:qwen3", *CLI_FLAGS, "--max-new-tokens", "4", "--chat", "hi"]) == 0
    out = capsys.readouterr().out
    model = demo_model("qwen3")
    reply = jaxspec.generate(model, [{"role": "user", "content": "hi"}], max_new_tokens=4).texts[0]
    assert out == reply + "\n"  # the reply only, not the prompt
