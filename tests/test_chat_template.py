"""Chat templates rendered by us against transformers' renderer, on SmolLM2's template and on one
that uses every helper transformers gives templates."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf
import pytest
from tokenizers.pre_tokenizers import ByteLevel

from wallbreaker.errors import InvalidRequestError, ModelNotFoundError
from wallbreaker.text.chat_template import ChatTemplate, encode_chat
from wallbreaker.formats.packaged import PACKAGED_MODELS, packaged_model_path
from wallbreaker.text.tokenizer import Tokenizer

CONVERSATIONS = {
    "system_user_assistant_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in French, with «quotes» and\nnewlines? 日本語 🤖"},
    ],
    "user_only": [{"role": "user", "content": "Hello!"}],
}


@pytest.fixture(scope="module")
def smollm2() -> tuple[dict[str, Any], Any]:
    from transformers import AutoTokenizer

    try:
        path = packaged_model_path("smollm2")
    except ModelNotFoundError:
        pytest.skip(f"smollm2 is not installed; install with: {PACKAGED_MODELS['smollm2'].install_command}")
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return metadata, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(
    smollm2: tuple[dict[str, Any], Any], conversation: str, add_generation_prompt: bool
) -> None:
    metadata, ref = smollm2
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    template = ChatTemplate(metadata["tokenizer.chat_template"], tokenizer.bos_token, tokenizer.eos_token)
    messages = CONVERSATIONS[conversation]
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    theirs = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    theirs = theirs["input_ids"] if isinstance(theirs, Mapping) else theirs
    assert encode_chat(tokenizer, template, messages, add_generation_prompt=add_generation_prompt) == theirs


HELPERS_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(first_user=none) %}
{%- for m in messages %}
    {%- if m.role == 'user' and ns.first_user is none %}{% set ns.first_user = loop.index0 %}{% endif %}
    {%- if m.role == 'stop' %}{% break %}{% endif %}
    {%- if m.role == 'skip' %}{% continue %}{% endif %}
    {%- if m.role == 'assistant' %}
<|assistant|>{% generation %}{{ m.content | trim }}{{ eos_token }}{% endgeneration %}
    {%- else %}
<|{{ m.role }}|>{{ m.content }}
    {%- endif %}
{%- endfor %}
{%- if tools %}
<|tools|>{{ tools | tojson }}|{{ tools[0] | tojson(indent=2, sort_keys=true) }}
{%- endif %}
first user at {{ ns.first_user }}; thinking={{ enable_thinking | default(true) }}; year={{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "<b>&</b>",
                                           "parameters": {"b": 1, "a": [True, None]}}}]


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS, "enable_thinking": False}])
def test_helpers_match_transformers(kwargs: dict[str, Any]) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "sys"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "  yo  "},
                {"role": "stop", "content": ""}, {"role": "user", "content": "never shown"}]
    ours = ChatTemplate(HELPERS_TEMPLATE, "<s>", "</s>").render(messages, add_generation_prompt=True, **kwargs)
    (theirs,), _ = render_jinja_template(conversations=[messages], chat_template=HELPERS_TEMPLATE,
                                         add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **kwargs)
    assert ours == theirs
    assert "never shown" not in ours
    assert ("météo" in ours and "<b>&</b>" in ours) == bool(kwargs)  # tojson neither escapes nor quotes HTML


def test_default_is_chatml() -> None:
    template = ChatTemplate(None, None, None)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert template.render(messages) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_assistant_tool_call_without_content_is_accepted() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content | default('-') }};{% endfor %}", None, None)
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    assert template.render(messages) == "user:x;assistant:-;"


@pytest.mark.parametrize("messages", [
    "hello",
    None,
    [["user", "hi"]],
    [{"content": "no role"}],
    [{"role": 1, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": "ok"}, {"role": "assistant", "content": None}],
])
def test_bad_messages(messages: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(None, None, None).render(messages)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source, fragment", [
    ("{{ raise_exception('Conversation roles must alternate\nuser/assistant') }}", "roles must alternate user/assistant"),
    ("{{ messages[0].content.upper( }}", "chat template does not compile"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
    ("{{ messages.append(1) }}", "chat template failed"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "not allowed"),
    ("{{ messages[0].content + 1 }}", "chat template failed"),
])
def test_template_errors(source: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        ChatTemplate(source, None, None).render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def byte_tokenizer(add_bos: bool) -> Tokenizer:
    """One token per byte plus <s> and </s>: every text encodes, so only the BOS handling shows."""
    tokens = ["<s>", "</s>", *sorted(ByteLevel.alphabet())]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, *[1] * (len(tokens) - 2)],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": add_bos,
    })


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("source", ["{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
                                    "{% for m in messages %}{{ m.content }}{% endfor %}"])
def test_encode_chat_has_one_bos_at_most(add_bos: bool, source: str) -> None:
    tokenizer = byte_tokenizer(add_bos)
    template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
    ids = encode_chat(tokenizer, template, [{"role": "user", "content": "hi"}])
    written = "bos_token" in source
    assert ids.count(0) == int(add_bos or written)
    assert tokenizer.decode(ids) == "hi"
    assert ids[0] == 0 or not (add_bos or written)


# -- untrusted templates: bounded time and size ----------------------------------------------------
ATTACKS = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over strings": "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "map over shared ranges": "{{ ([range(100000)] * 100000)|map('list')|map('length')|sum }}",
    "gigabyte string": "{{ 'a' * 1000000000 }}",
    "gigabyte string at run time": "{% set n = 10 ** 9 %}{% set x = 'a' * n %}ok",
    "gigabyte list": "{% set x = [0] * 1000000000 %}",
    "huge power": "{% set e = 10 ** 9 %}{{ 7 ** e }}",
    "repeated squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with replace": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
    "doubling with .replace": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s.replace('a', 'aa') %}{% endfor %}",
    "center filter": "{{ 'a'|center(1000000000) }}",
    "ljust method": "{% set w = 10 ** 9 %}{{ 'a'.ljust(w) }}",
    "format width": "{{ '{:>1000000000}'.format('a') }}",
    "nested format width": "{{ '{:>{w}}'.format('a', w=1000000000) }}",
    "percent width": "{{ '%1000000000s' % 'a' }}",
    "percent star width": "{{ '%*s' % (1000000000, 'a') }}",
    "format filter width": "{{ '%1000000000s'|format('a') }}",
    "indent": "{{ ('x\n' * 1000)|indent(1000000) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(1000000) }}",
    "output of a big string many times": "{% set big = 'x' * 1000000 %}{% for i in range(100000) %}{{ big }}{% endfor %}",
    "join of a lazy map": "{{ range(100000)|map('center', 1000000)|join }}",
    "str.join of a lazy map": "{{ ''.join(range(100000)|map('center', 1000000)) }}",
    "tojson of shared references": "{% set big = 'x' * 1000000 %}{{ ([big] * 1000)|tojson }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=1000000000) }}",
    "output of a list of references": ("{% set big = 'x' * 3000000 %}{% set l = [big, big, big, big, big, big, big, big] %}"
                                       "{{ [l, l, l, l, l, l, l, l, l, l] }}"),
    "batch fill": "{{ range(3)|batch(1000000000, 'x')|list }}",
    "slice count": "{{ range(3)|slice(1000000000)|list }}",
    "sum of lists": "{% set l = range(100000)|list %}{{ ([l] * 1000)|sum(start=[])|length }}",
    "urlize": "{{ ('a.b ' * 1000000)|urlize }}",
    # Loops whose bodies call nothing, and growth that no intercepted operator sees.
    "bare loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% set c = b %}{% endfor %}{% endfor %}",
    "~ of a list of references": ("{% set big = 'x' * 3000000 %}{% set l = [big, big, big, big, big, big, big, big] %}"
                                  "{{ ([l, l, l, l, l, l, l, l, l, l] ~ '')|length }}"),
    "doubling with ~ through macro calls": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 64) }}",
    "map(attribute=) over a long string": "{{ ('x' * 4000000)|map(attribute='a')|list|length }}",
    "select over a long string": "{{ ('x' * 4000000)|select('string')|list|length }}",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_templates_fail_fast(name: str) -> None:
    """Unfixed, each of these hung its thread (the loops, at 100% CPU for hours) or tried to
    allocate gigabytes: most while the template compiled, as Jinja folds constant expressions."""
    import resource
    import time

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="^chat template exceeded its (time|size) limit") as info:
        ChatTemplate(ATTACKS[name], None, None).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 2.5
    assert "\n" not in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 400 * 1024  # KiB


@pytest.mark.parametrize("source", ["{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                                    "{% for i in [1] recursive %}{{ loop([1]) }}{% endfor %}"])
def test_unbounded_recursion_fails_cleanly(source: str) -> None:
    with pytest.raises(InvalidRequestError, match="^chat template failed: RecursionError") as info:
        ChatTemplate(source, None, None).render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_filters_that_take_the_context_still_work() -> None:
    """Every filter is wrapped to check the limits; jinja must still pass the context, eval
    context or environment to those that ask for it."""
    source = ("{{ [3, 1, 3]|unique|list }} {{ 'a-b'|replace('-', '+') }} {{ messages|join(',', attribute='role') }} "
              "{{ [{'n': 1}, {'n': 2}]|sum(attribute='n') }} {{ messages|map(attribute='content')|first }} "
              "{{ [1, 2, 3]|select('odd')|list }} {{ messages|groupby('role')|length }} {{ 'a b'|wordwrap(1) }}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ChatTemplate(source, None, None).render(messages) == "[3, 1] a+b user,assistant 3 hi [1, 3] 2 a\nb"


def test_no_module_uses_jinja2_internals() -> None:
    """The limits rest on jinja2's public API (the sandbox's hooks, extensions, syntax-tree nodes),
    so that a jinja2 upgrade keeps them or fails loudly: no code generator subclass, no private name."""
    import ast
    import re
    from pathlib import Path

    import wallbreaker

    for path in Path(wallbreaker.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jinja2"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("jinja2")]
            else:
                continue
            for name in names:
                assert not name.startswith("jinja2.compiler") and not re.search(r"\._(?!_)", name), f"{path}: {name}"
        private = r"\bjinja2(\.\w+)*\._(?!_)|\b_[A-Z]\w*__\w|code_generator_class|CodeGenerator"
        assert not re.search(private, text), f"{path}: {re.search(private, text)}"


def test_lipsum_is_not_offered() -> None:
    with pytest.raises(InvalidRequestError, match="lipsum"):
        ChatTemplate("{{ lipsum(1000000000) }}", None, None).render([{"role": "user", "content": "hi"}])


def test_limits_are_per_template_and_leave_normal_renders_alone() -> None:
    messages = [{"role": "user", "content": "x" * 1000}] * 50
    assert len(ChatTemplate(None, None, None).render(messages)) > 50_000
    with pytest.raises(InvalidRequestError, match="more than 10000 characters of output"):
        ChatTemplate(None, None, None, max_chars=10_000).render(messages)
    slow = "{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="time limit of 0.1 s"):
        ChatTemplate(slow, None, None, max_render_s=0.1).render(messages)
    big = "{% set s = 'ab' * 1000000 %}{{ s|length }} {{ (s ~ s)|length }} {{ s.center(3000000)|length }}"
    assert ChatTemplate(big, None, None).render(messages) == "2000000 4000000 3000000"


def test_renders_in_threads_have_their_own_deadlines() -> None:
    import threading

    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", None, None)
    fast = ChatTemplate(None, None, None)
    errors: list[str] = []

    def run() -> None:
        try:
            slow.render([{"role": "user", "content": "hi"}])
        except InvalidRequestError as e:
            errors.append(str(e))
    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(200):
        assert fast.render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")
    thread.join(10)
    assert errors and "time limit" in errors[0]


def test_jinja2_older_than_3_1_6_is_refused() -> None:
    import jinja2

    from wallbreaker.text.chat_template import check_jinja2_version

    for version in ("3.1.5", "3.1.0", "3.0.3", "2.11.3"):
        with pytest.raises(ImportError, match=r"jinja2>=3\.1\.6.*CVE-2024-56326.*CVE-2025-27516"):
            check_jinja2_version(version)
    for version in ("3.1.6", "3.1.7.dev0", "3.2.0", "4.0"):
        check_jinja2_version(version)
    check_jinja2_version(jinja2.__version__)  # what is installed passes: the module imported
