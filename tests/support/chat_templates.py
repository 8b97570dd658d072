"""Chat templates for tests, applied to the tiny models' tokenizer.

``QWEN_STYLE_TEMPLATE`` has the shape of Qwen3's template: ChatML; consecutive ``tool`` messages
rendered together as one ``<|im_start|>user`` turn of ``<tool_response>`` blocks; an assistant
message's ``<think>...</think>`` reasoning dropped when it comes before the last user query (a
user turn that is not itself a tool response), kept (re-formatted) after it; ``tool_calls``
written as ``<tool_call>`` JSON blocks; ``enable_thinking=False`` adds an empty think block to the
generation prompt.
"""

from __future__ import annotations

QWEN_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query=messages|length - 1) %}
{%- for m in messages[::-1] %}
    {%- set i = messages|length - 1 - loop.index0 %}
    {%- if ns.searching and m.role == 'user' and not (m.content.startswith('<tool_response>')
                                                      and m.content.endswith('</tool_response>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = i %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content if m.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- set f = call.function if call.function is defined else call %}
            {%- if not loop.first or content %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {{- f.arguments if f.arguments is string else f.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
