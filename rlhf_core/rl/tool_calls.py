"""Tool calls in a completion's text, in the formats chat templates teach (pure): the parsers by
format name (`PARSERS`), reading a completion's calls in one (`read_calls`, which types the text
values of `TEXT_VALUED` formats by the request's tool schemas) and the format a chat template
teaches (`detect`). Each format's parser lives in `rl/tool_formats/`, grouped by how its calls are
written; its module's docstring describes it.

Each parser returns `(content, [(name, arguments as a JSON string), ...])`, read as vLLM's parser
of the same name reads a whole completion: if any call is malformed, nothing is a call and the
whole text is content, unless its module says otherwise (minicpm5, poolside_v1, muse_glimmer and hf
keep the well-formed calls beside malformed ones, as vLLM's readers do). DeepSeek's DSML formats and
dots.llm's (`BY_REQUEST`) are given the typing as they read, since only the values they mark as
not strings (dots: those of its XML calls) are typed.

`detect(chat_template)` names the format a template teaches, by the markers it writes (Llama 3.2's
pythonic templates show the model `[func_name1(params_name1=params_value1, ...)]`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from rlhf_core.rl.tool_formats.cohere import (
    COHERE_ACTION,
    COHERE_TEXT,
    parse_cohere_command3,
    parse_cohere_command4,
)
from rlhf_core.rl.tool_formats.common import START, Calls
from rlhf_core.rl.tool_formats.gemma import FUNCTIONGEMMA_CALL, GEMMA_CALL, parse_functiongemma, parse_gemma4
from rlhf_core.rl.tool_formats.harmony import HARMONY_CHANNEL, parse_openai
from rlhf_core.rl.tool_formats.inkling import INKLING_CALL, parse_inkling, read_inkling
from rlhf_core.rl.tool_formats.json_lists import (
    APERTUS_CALLS,
    GRANITE_MARKERS,
    MISTRAL_CALLS,
    PHI4_CALLS,
    TOOL_CALLS,
    parse_apertus,
    parse_granite,
    parse_hunyuan_a13b,
    parse_jamba,
    parse_minimax,
    parse_mistral,
    parse_phi4_mini_json,
    parse_qwen2_5_coder,
    parse_xlam,
)
from rlhf_core.rl.tool_formats.json_objects import (
    GRANITE_FC_CALL,
    INTERNLM_CALL,
    LONGCAT_CALL,
    PYTHON_TAG,
    parse_ernie45,
    parse_gigachat3,
    parse_granite4,
    parse_granite_20b_fc,
    parse_hermes,
    parse_internlm2,
    parse_llama3_json,
    parse_longcat,
)
from rlhf_core.rl.tool_formats.k2_horizon import K2_HORIZON_CALLS, parse_k2_horizon, read_k2_horizon
from rlhf_core.rl.tool_formats.k2_horizon import TOOL_FORMATS as K2_TOOL_FORMATS
from rlhf_core.rl.tool_formats.k2_horizon import XML as K2_XML
from rlhf_core.rl.tool_formats.minicpm5 import MINICPM5_PARAM, parse_minicpm5, read_minicpm5
from rlhf_core.rl.tool_formats.minimax_m3 import MINIMAX_M3_NS, parse_minimax_m3, read_minimax_m3
from rlhf_core.rl.tool_formats.muse_glimmer import MUSE_CALLS, parse_muse_glimmer, read_muse_glimmer
from rlhf_core.rl.tool_formats.poolside import POOLSIDE_TOOLS, parse_poolside_v1, read_poolside_v1
from rlhf_core.rl.tool_formats.python_calls import OLMO3_CALLS, parse_lfm2, parse_olmo3, parse_pythonic
from rlhf_core.rl.tool_formats.sectioned import (
    DEEPSEEK_CALLS,
    KIMI_CALLS,
    PLAMO_CALLS,
    parse_deepseek_v3,
    parse_deepseek_v31,
    parse_kimi_k2,
    parse_plamo3,
)
from rlhf_core.rl.tool_formats.xml_calls import (
    DOTS_CALLS,
    DSML_FUNCTION_CALLS,
    DSML_TOOL_CALLS,
    DSML_V41_CALLS,
    HY_SEP,
    MINIMAX_CALLS,
    SEED_CALL,
    STEP3_CALLS,
    Typing,
    parse_deepseek_v4,
    parse_deepseek_v32,
    parse_deepseek_v41,
    parse_dots,
    parse_glm45,
    parse_glm47,
    parse_hy_v3,
    parse_hy_v4,
    parse_minimax_m2,
    parse_qwen3_coder,
    parse_seed_oss,
    parse_step3,
    read_dots,
    read_dsml,
)
from rlhf_core.rl.tool_formats.xtml import XTML_OPEN, parse_kimi_k3


def tool_properties(name: str, tools: list[dict] | None) -> dict | None:
    """The schemas of the parameters of the request's tool `name` (None where it declares none)."""
    schema = next((t.get("function", {}).get("parameters") for t in tools or ()
                   if isinstance(t, dict) and isinstance(t.get("function"), dict)
                   and t["function"].get("name") == name), None)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else None


def tool_names(tools: list[dict] | None) -> set[str]:
    """The names of the request's tools."""
    return {t["function"]["name"] for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)}


def typed_arguments(name: str, arguments: str, tools: list[dict] | None) -> str:
    """A text-valued format's (TEXT_VALUED) string values as the request's tool schema types them (a
    number, a boolean, an object or array as JSON); a value that does not read as its type stays a string."""
    properties = tool_properties(name, tools)
    if properties is None:
        return arguments
    values = json.loads(arguments)
    for key, value in values.items():
        kind = (properties.get(key) or {}).get("type") if isinstance(properties.get(key), dict) else None
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if not isinstance(value, str) or "string" in kinds or not kinds & {"integer", "number", "boolean",
                                                                            "object", "array", "null"}:
            continue
        try:
            typed = json.loads(value)
        except ValueError:
            continue
        if (("integer" in kinds and isinstance(typed, int) and not isinstance(typed, bool))
                or ("number" in kinds and isinstance(typed, int | float) and not isinstance(typed, bool))
                or ("boolean" in kinds and isinstance(typed, bool)) or ("object" in kinds and isinstance(typed, dict))
                or ("array" in kinds and isinstance(typed, list)) or ("null" in kinds and typed is None)):
            values[key] = typed
    return json.dumps(values, ensure_ascii=False)


PARSERS: dict[str, Callable[[str], Calls]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral, "pythonic": parse_pythonic,
    "qwen3_coder": parse_qwen3_coder, "deepseek_v3": parse_deepseek_v3, "deepseek_v31": parse_deepseek_v31,
    "kimi_k2": parse_kimi_k2, "granite": parse_granite, "glm45": parse_glm45, "minimax_m2": parse_minimax_m2,
    "seed_oss": parse_seed_oss, "step3": parse_step3, "xlam": parse_xlam, "phi4_mini_json": parse_phi4_mini_json,
    "internlm2": parse_internlm2, "jamba": parse_jamba, "hunyuan_a13b": parse_hunyuan_a13b, "longcat": parse_longcat,
    "olmo3": parse_olmo3, "ernie45": parse_ernie45, "openai": parse_openai, "granite4": parse_granite4,
    "lfm2": parse_lfm2, "apertus": parse_apertus, "cohere_command3": parse_cohere_command3,
    "cohere_command4": parse_cohere_command4, "glm47": parse_glm47, "deepseek_v32": parse_deepseek_v32,
    "deepseek_v4": parse_deepseek_v4, "deepseek_v41": parse_deepseek_v41, "kimi_k3": parse_kimi_k3, "gemma4": parse_gemma4,
    "minimax": parse_minimax, "qwen2_5_coder": parse_qwen2_5_coder, "hy_v3": parse_hy_v3, "hy_v4": parse_hy_v4,
    "functiongemma": parse_functiongemma, "dots": parse_dots, "gigachat3": parse_gigachat3,
    # vLLM's qwen3_xml reads Qwen3-Coder's calls (with an XML reader of its own): the same syntax
    "qwen3_xml": parse_qwen3_coder,
    # aliases: vLLM's step3p5 (Step-3.5, qwen3_xml's reader) and mimo (MiMo, the reader of qwen3_coder)
    # read Qwen3-Coder's XML calls; llama4_pythonic reads pythonic's calls, `<|python_start|>`
    # ... `<|python_end|>` wrapping dropped (which `parse_pythonic` drops too)
    "step3p5": parse_qwen3_coder, "mimo": parse_qwen3_coder, "llama4_pythonic": parse_pythonic,
    # vLLM's names for readers above: internlm (InternLM2's), llama4_json (Llama 3's JSON calls, which
    # Llama 4's JSON templates write), qwen3_json (Qwen2.5/QwQ/Qwen3's JSON calls: Hermes' blocks)
    "internlm": parse_internlm2, "llama4_json": parse_llama3_json, "qwen3_json": parse_hermes,
    "granite-20b-fc": parse_granite_20b_fc, "plamo3": parse_plamo3, "minimax_m3": parse_minimax_m3,
    # vLLM's ling3 (Ling 3) reads GLM-4.7's calls
    "ling3": parse_glm47, "minicpm5": parse_minicpm5, "k2_horizon": parse_k2_horizon, "inkling": parse_inkling,
    "muse_glimmer": parse_muse_glimmer, "poolside_v1": parse_poolside_v1}
# formats that write every argument value as text
TEXT_VALUED = frozenset({"qwen3_coder", "qwen3_xml", "step3p5", "mimo", "glm45", "glm47", "ling3", "minimax_m2",
                         "seed_oss", "step3", "hy_v3", "hy_v4"})
# formats read with the request's tools in their own way (as vLLM's reader of each does): DeepSeek's
# DSML and dots.llm's mark which values are strings and type the others as they read (`read_dsml`,
# `read_dots`: dots' invokes' values are text, its JSON calls' typed as written); values typed or
# nested elements shaped by each tool's parameter schemas (`properties_of(name)`); a call named
# after no tool of the request's refused (k2_horizon, where the request has tools); a doubled name
# `X.X` read as the tool `X` (muse_glimmer)
BY_REQUEST: dict[str, Callable[[str, list[dict] | None, dict], Calls]] = {
    "deepseek_v32": lambda text, tools, kw: read_dsml(text, DSML_FUNCTION_CALLS, _typing(tools)),
    "deepseek_v4": lambda text, tools, kw: read_dsml(text, DSML_TOOL_CALLS, _typing(tools)),
    "deepseek_v41": lambda text, tools, kw: read_dsml(text, DSML_V41_CALLS, _typing(tools)),
    "dots": lambda text, tools, kw: read_dots(text, _typing(tools)),
    "minimax_m3": lambda text, tools, kw: read_minimax_m3(text, _properties_of(tools)),
    "minicpm5": lambda text, tools, kw: read_minicpm5(text, _properties_of(tools)),
    "inkling": lambda text, tools, kw: read_inkling(text, _properties_of(tools)),
    "poolside_v1": lambda text, tools, kw: read_poolside_v1(text, _properties_of(tools)),
    "k2_horizon": lambda text, tools, kw: read_k2_horizon(
        text, _properties_of(tools), k2_tool_format(kw), known=tool_names(tools).__contains__ if tools else None),
    "muse_glimmer": lambda text, tools, kw: read_muse_glimmer(text, tool_names(tools))}


def _typing(tools: list[dict] | None) -> Typing:
    return lambda name, arguments: typed_arguments(name, arguments, tools)


def _properties_of(tools: list[dict] | None) -> Callable[[str], dict | None]:
    return lambda name: tool_properties(name, tools)


# vLLM's `hf`: the format a tokenizer's `response_template` describes, read with the prompt before the
# completion (`tool_formats/response_template`, which the endpoint calls); a choice beside PARSERS' names
RESPONSE_TEMPLATE = "hf"


def k2_tool_format(template_kwargs: dict) -> str:
    """The syntax K2 Horizon's template writes calls in: the request's `tool_call_format` chat-template
    argument (vLLM's k2_horizon reads it so), `xml` without one; ValueError for another value."""
    value = template_kwargs.get("tool_call_format", K2_XML)
    if not isinstance(value, str) or value not in K2_TOOL_FORMATS:
        raise ValueError(f"chat_template_kwargs tool_call_format {value!r}: K2 Horizon's calls are written in one "
                         f"of {', '.join(K2_TOOL_FORMATS)}")
    return value


def check_template_kwargs(fmt: str, template_kwargs: dict) -> None:
    """ValueError where a request's chat-template arguments name a call syntax format `fmt` has not
    (K2 Horizon's `tool_call_format`: the only format whose syntax a request chooses)."""
    if fmt == "k2_horizon":
        k2_tool_format(template_kwargs)


def read_calls(fmt: str, text: str, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> Calls:
    """`text`'s calls in format `fmt` (a name of PARSERS); a format that writes every value as text
    has them typed by the request's tool schemas (TEXT_VALUED, `typed_arguments`); others read the
    request's tools (and K2 Horizon the request's chat-template arguments) their own way
    (BY_REQUEST)."""
    if fmt in BY_REQUEST:
        return BY_REQUEST[fmt](text, tools, template_kwargs or {})
    content, calls = PARSERS[fmt](text)
    if fmt in TEXT_VALUED:
        calls = [(name, typed_arguments(name, arguments, tools)) for name, arguments in calls]
    return content, calls


GRANITE_ROLE = "<|start_of_role|>"  # what Granite's templates write before each role

# The marker each format's chat templates write, in the order they are looked for (Qwen3-Coder's
# and GLM's templates write <tool_call> too; DeepSeek-V3's write V3.1's markers and a ```json fence;
# Jamba's write <tool_calls> as Hunyuan-A13B's do, found by their <tool_definitions>; a template
# writing both <tool_call> and <tool_calls> stays Hermes'). ERNIE-4.5 writes only Hermes' <tool_call>;
# Granite 4's write it with Granite's <|start_of_role|> (`detect`). Cohere's cmd4 templates write
# <|START_TEXT|> besides the <|START_ACTION|> of cmd3's; LFM2's write their tool list's marker.
# DeepSeek-V3.2's, V4's and V4.1's DSML sections, Gemma 4's <|tool_call>, Kimi K3's <|open|> channels and
# MiniMax-M3's marker (its templates write <tool_call> after it), MiniCPM5's <param name= (its
# templates write Hy3's <tool_sep> too), K2 Horizon's <ifm|tool_calls>, Inkling's
# <|content_invoke_tool_json|>, Muse's <atem:function_calls> and Laguna's (poolside_v1) <available_tools>
# (its templates write <tool_call> and GLM's <arg_key> too) are
# their own (GLM-4.7's templates read as glm45's, Qwen3's XML as qwen3_coder's: name glm47 or qwen3_xml),
# as are FunctionGemma's <start_function_call>, dots.llm's <dots_function_call> and Hy3's <tool_sep>
# (found before GLM's <arg_key>, which it writes too), and granite-20b-fc's <function_call> (looked
# for last). Step-3.5's and MiMo's templates read as qwen3_coder's, Llama 4's as pythonic's (the same
# calls); MiniMax-M1's <tool_calls>, Qwen2.5-Coder's <tools>, Hunyuan v4's and GigaChat 3's markers
# are not their own: name minimax, qwen2_5_coder, hy_v4 or gigachat3.
_MARKERS = (("deepseek_v32", DSML_FUNCTION_CALLS), ("deepseek_v4", DSML_TOOL_CALLS), ("deepseek_v41", DSML_V41_CALLS),
            ("gemma4", GEMMA_CALL), ("kimi_k3", XTML_OPEN), ("minimax_m3", MINIMAX_M3_NS),
            ("minicpm5", MINICPM5_PARAM), ("k2_horizon", K2_HORIZON_CALLS), ("inkling", INKLING_CALL),
            ("muse_glimmer", MUSE_CALLS), ("functiongemma", FUNCTIONGEMMA_CALL), ("dots", DOTS_CALLS),
            ("poolside_v1", POOLSIDE_TOOLS),
            ("seed_oss", SEED_CALL), ("step3", STEP3_CALLS), ("qwen3_coder", "<parameter="), ("hy_v3", HY_SEP),
            ("glm45", "<arg_key>"),
            ("minimax_m2", MINIMAX_CALLS), ("longcat", LONGCAT_CALL), ("internlm2", INTERNLM_CALL),
            ("openai", HARMONY_CHANNEL), ("lfm2", "<|tool_list_start|>"), ("apertus", APERTUS_CALLS),
            ("cohere_command4", COHERE_TEXT), ("cohere_command3", COHERE_ACTION), ("jamba", "<tool_definitions>"), ("hermes", START), ("hunyuan_a13b", TOOL_CALLS),
            ("olmo3", OLMO3_CALLS), ("deepseek_v31", DEEPSEEK_CALLS), ("kimi_k2", KIMI_CALLS),
            ("granite", GRANITE_MARKERS[0]), ("mistral", MISTRAL_CALLS), ("phi4_mini_json", PHI4_CALLS + "["),
            ("pythonic", "<|python_start|>"), ("pythonic", "[func_name1("), ("llama3_json", PYTHON_TAG),
            ("granite-20b-fc", GRANITE_FC_CALL), ("plamo3", PLAMO_CALLS))


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches (the first of its markers it writes), or None."""
    found = next((name for name, marker in _MARKERS if chat_template and marker in chat_template), None)
    if found == "deepseek_v31" and "```json" in chat_template:
        return "deepseek_v3"
    if found == "hermes" and GRANITE_ROLE in chat_template:
        return "granite4"
    return found
