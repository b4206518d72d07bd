"""One chat-template renderer for both engines (engines/chat_template.py, issue 73), checked
against transformers' own apply_chat_template on the embedded model's tokenizer with its
template replaced by one that uses what transformers gives a template: strftime_now,
tojson (with `<` and non-ASCII text kept, and json.dumps' arguments), raise_exception,
loop controls; and the {% generation %} block, dict() and namespace() in the helper alone.  granite-3.1's template calls strftime_now;
before the shared helper the openai engine failed to start on it and the torch engine
answered every chat request 400."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.engines import openai_engine
from warmup_agent import config
from warmup_agent.engines import chat_template

TEMPLATE = (
    "{%- set today = strftime_now('%Y-%m-%d') -%}\n"
    "{{ bos_token }}<|system|>Knowledge cutoff: 2024. Today: {{ today }}.\n"
    "{% for message in messages %}\n"
    "  {% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
    "<|{{ message['role'] }}|>\n"
    "  {% if message['role'] == 'assistant' %}\n"
    "{{ message['content'] }}{{ eos_token }}\n"
    "  {% elif message['role'] == 'system' %}\n"
    "meta={{ message | tojson }} compact={{ message | tojson(separators=(',', ':'), sort_keys=True) }}\n"
    "  {% else %}\n"
    "{{ message['content'] }}\n"
    "{{ {'b': [1, '<é>'], 'a': message['role']} | tojson(indent=2) }}\n"
    "  {% endif %}\n"
    "  {% if loop.index > 8 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if tools is not none %}<|tools|>{% endif %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Answer in French: <b>é</b> & naïve café, 日本語"},
    {"role": "user", "content": "Is 3 < 5 > 2? <|user|> \"quoted\" \u2063"},
    {"role": "assistant", "content": "Oui, c'est ça: 3 < 5."},
    {"role": "user", "content": "Merci <script>é</script>"},
]


@pytest.fixture(scope="module")
def model_dir(embedded_model, tmp_path_factory) -> str:
    """The embedded model with TEMPLATE as its chat template (weights linked, not copied)."""
    out = str(tmp_path_factory.mktemp("templated") / "embedded-llama-v1")
    os.makedirs(out)
    for name in os.listdir(embedded_model):
        src = os.path.join(embedded_model, name)
        if name == "chat_template.jinja" or not os.path.isfile(src):
            continue
        if name == "tokenizer_config.json":
            with open(src, encoding="utf-8") as f:
                cfg = json.load(f)
            cfg["chat_template"] = TEMPLATE
            with open(os.path.join(out, name), "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2)
        elif name.endswith((".json", ".txt", ".model")):
            shutil.copy(src, out)
        else:
            os.symlink(src, os.path.join(out, name))
    return out


@pytest.fixture(scope="module")
def reference(model_dir) -> str:
    """MESSAGES rendered by transformers."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "strftime_now" not in text and "<é>" in text and "3 < 5" in text   # the template did its work
    return text


def test_the_reference_uses_all_of_the_template(reference):
    from datetime import datetime
    assert f"Today: {datetime.now():%Y-%m-%d}" in reference
    assert 'meta={"role": "system", "content": "Answer in French: <b>é</b> & naïve café, 日本語"}' in reference
    assert 'compact={"content":"Answer in French: <b>é</b> & naïve café, 日本語","role":"system"}' in reference
    assert "\nMerci <script>é</script>\n" in reference
    assert '{\n  "b": [\n    1,\n    "<é>"\n  ],' in reference                             # indent
    assert reference.endswith("<|assistant|>\n") and "<|tools|>" not in reference


def test_the_helper_renders_as_transformers(model_dir, reference):
    template = chat_template.compile_template(chat_template.read_source(model_dir))
    assert chat_template.render(template, MESSAGES, chat_template.special_tokens(model_dir)) == reference
    with pytest.raises(chat_template.TemplateRefused, match="no tools here"):
        chat_template.render(template, [{"role": "tool", "content": "x"}])


# The rest of what transformers gives a template: the {% generation %} block, its guarded
# dict() and namespace(), messages without their None-valued keys.
OTHER_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% set d = dict(a=1, b='<é>') %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
    "{% else %}{{ m['role'] }}:{{ m['content'] if m['content'] is defined else 'NONE' }}|{% endif %}{% endfor %}"
    "{{ ns.n }} {{ d | tojson }}{% if add_generation_prompt %}>{% endif %}"
)


def test_the_helper_renders_the_rest_as_transformers(model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "a < b"}, {"role": "assistant", "content": "é"},
                {"role": "user", "content": None}]
    expected = tok.apply_chat_template(messages, chat_template=OTHER_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert expected == 'user:a < b|[é]user:NONE|3 {"a": 1, "b": "<é>"}>'
    assert chat_template.render(chat_template.compile_template(OTHER_TEMPLATE), messages) == expected


def test_openai_engine_renders_prompts_as_transformers(model_dir, reference):
    """The openai engine's warmup prompts (engine.text): the template loads at start and renders
    the same text transformers gives, so the prompt warmed is the prompt the server gets."""
    engine = openai_engine(config.load(env={}), server_command=["true"], model_path=model_dir)
    engine.load_tokenizer()
    assert engine.text is not None and engine.text.has_chat_template
    assert engine.text.render(MESSAGES) == reference
    assert engine.text.opening_tokens() > 0
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages, n = engine.text.messages(400)        # a warmup prompt sized through the template
    assert n == 400
    assert n == len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False))


@pytest.fixture(scope="module")
def torch_engine(model_dir):
    from warmup_agent.engines.torch.engine import TorchEngine
    e = TorchEngine(model_dir, device="cpu")
    e.load_weights()
    e.load_tokenizer()
    e.solidify([(16, 1)])
    yield e
    e.close()


def test_torch_engine_serves_the_template_behind_the_proxy(torch_engine, reference):
    """A chat request through the routing proxy answers 200 with the prompt transformers renders."""
    import openai
    from transformers import AutoTokenizer

    from exporter.metrics import AgentMetrics
    from warmup_agent.pipeline import Agent
    from warmup_agent.proxy import RoutingProxy
    from warmup_agent.states import State

    backend = torch_engine.openai_backend()
    assert backend.template.render(MESSAGES) == reference
    agent = Agent(config.load(env={}), torch_engine, metrics=AgentMetrics())
    for s in (State.PRELOAD, State.PRIME, State.SERVING):
        assert agent.sm.transition(s)
    proxy = RoutingProxy(agent, backend, retry_after_seconds=7).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="unused", max_retries=0, timeout=60)
        raw = c.chat.completions.with_raw_response.create(model="embedded-llama-v1", messages=MESSAGES,  # type: ignore[arg-type]
                                                          max_tokens=3, temperature=0)
        assert raw.http_response.status_code == 200
        out = raw.parse()
        tok = AutoTokenizer.from_pretrained(torch_engine.model_path)
        assert out.usage is not None and out.usage.prompt_tokens == len(tok.encode(reference, add_special_tokens=False))
        with pytest.raises(openai.BadRequestError, match="refused the messages: no tools here"):
            c.chat.completions.create(model="embedded-llama-v1", messages=[{"role": "tool", "content": "x",  # type: ignore[list-item,misc]
                                                                           "tool_call_id": "1"}], max_tokens=3)
    finally:
        proxy.stop()
        backend.batcher.close()
