"""The tool-call formats chat templates teach, one parser each, grouped by how their calls are
written; `rl/tool_calls.py` names them (PARSERS) and is what the rest of the code reads them through.

- `common`: what every format shares (`Calls`, the error for a text that is no call, Hermes'
  `<tool_call>` block, the `<tool_calls>` section's markers, reading a JSON call object).
- `json_objects`: each call one JSON object, in or after a marker (hermes, longcat, ernie45, granite4,
  internlm2, llama3_json, gigachat3, granite-20b-fc).
- `json_lists`: the calls a JSON list after or inside a marker (mistral, granite, jamba, hunyuan_a13b,
  xlam, phi4_mini_json, apertus, minimax, qwen2_5_coder).
- `python_calls`: Python-list calls with literal keyword arguments (pythonic, olmo3, lfm2).
- `xml_calls`: XML-like calls whose values are written as text (qwen3_coder, seed_oss, glm45, glm47,
  minimax_m2, step3, hy_v3, hy_v4, dots, and DeepSeek's DSML: deepseek_v32, deepseek_v4, deepseek_v41).
- `sectioned`: a section of calls, each between its own begin and end tokens (deepseek_v3,
  deepseek_v31, kimi_k2, plamo3).
- `harmony`: gpt-oss's harmony messages (openai).
- `cohere`: Cohere Command's action sections (cohere_command3, cohere_command4).
- `xtml`: Kimi K3's channels, the calls its `tools` channel's (kimi_k3).
- `gemma`: Gemma's `call:NAME{...}` calls in its own notation of values (gemma4, functiongemma).
- `minimax_m3`: MiniMax-M3's nested elements after its `]<]minimax[>[` marker, shaped by the
  request's tool schema (minimax_m3).
- `minicpm5`: MiniCPM5's `<function name=...><param name=...>` blocks, read as XML or by their tags,
  values as JSON or Python literals (minicpm5).
- `k2_horizon`: K2 Horizon's `<ifm|tool_calls>` group, key/value pairs or JSON calls (k2_horizon).
- `inkling`: Inkling's `<|content_invoke_tool_json|>` blocks of JSON calls (inkling).
- `muse_glimmer`: Muse's ATEM invokes in messages addressed to a tool (muse_glimmer).
- `poolside`: Laguna's GLM-like `<arg_key>`/`<arg_value>` calls, values as JSON or Python literals
  (poolside_v1).
- `schema_types`: a text value typed by the tool schema as vLLM types nested or typed values
  (minimax_m3, k2_horizon, inkling).
- `response_template`: the format a tokenizer's `response_template` describes (transformers' reply
  parsing), read as vLLM's `hf` reads it, with the prompt before the completion (hf).
- Aliases, named in `rl/tool_calls.py` (PARSERS): qwen3_xml, step3p5 and mimo read qwen3_coder's
  calls, llama4_pythonic pythonic's; internlm, llama4_json and qwen3_json are vLLM's names for the
  internlm2, llama3_json and hermes readers; ling3 reads glm47's calls.
"""
