//! Chat templates render as Hugging Face renders them, including the Python
//! string methods Qwen3- and Gemma-style templates call, and rendering is
//! bounded (fuel and output size).
//!
//! The templates here are written for these tests; they use the same
//! constructs as the Qwen3 and Gemma 3 templates on the Hub (reversed
//! slices, `namespace`, `.startswith`/`.endswith`/`.split`/`.strip`/
//! `.rstrip`/`.lstrip`, `| trim`, `raise_exception`, role alternation checks).

use kiln_runtime::chat::{ChatError, ChatMessage, ChatTemplate, MAX_RENDERED_BYTES};

/// Qwen3-style: the last user query found by walking the messages backwards,
/// thinking blocks split out of assistant turns with Python string methods.
const QWEN3_STYLE: &str = r#"{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// Gemma-style: a system message folded into the first user turn, strict
/// user/model alternation enforced with `raise_exception`, `model` for the
/// assistant role, `| trim` on contents.
const GEMMA_STYLE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"#;

#[test]
fn a_qwen3_style_template_renders_with_python_string_methods() {
    let t = ChatTemplate::new(QWEN3_STYLE, None, Some("<|im_end|>"));
    let msgs = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::new("assistant", "<think>\nlet me think\n</think>\n\nHello!"),
        ChatMessage::user("What is 2+2?"),
    ];
    let out = t.render(&msgs, true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn a_qwen3_style_template_keeps_thinking_after_the_last_query() {
    let t = ChatTemplate::new(QWEN3_STYLE, None, None);
    let msgs = [
        ChatMessage::user("Hi"),
        ChatMessage::new("assistant", "<think>\nhmm\n</think>\n\nHello!"),
    ];
    let out = t.render(&msgs, false).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello!<|im_end|>\n"
    );
}

#[test]
fn a_gemma_style_template_folds_the_system_prompt_and_trims() {
    let t = ChatTemplate::new(GEMMA_STYLE, Some("<bos>"), Some("<eos>"));
    let msgs = [
        ChatMessage::system("  Be brief. "),
        ChatMessage::user(" Hi "),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::user("Bye"),
    ];
    let out = t.render(&msgs, true).unwrap();
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
         <start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n\
         <start_of_turn>model\n"
    );
}

#[test]
fn a_gemma_style_template_raises_on_broken_alternation() {
    let t = ChatTemplate::new(GEMMA_STYLE, Some("<bos>"), None);
    let msgs = [ChatMessage::user("a"), ChatMessage::user("b")];
    let e = t.render(&msgs, true).unwrap_err();
    assert!(matches!(e, ChatError::Render(_)), "{e}");
    assert!(e.to_string().contains("must alternate"), "{e}");
}

#[test]
fn chat_template_jinja_is_preferred_over_tokenizer_config() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "from config", "bos_token": "<s>", "eos_token": {"content": "</s>"}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{{ messages[0].content.upper() }}{{ eos_token }}",
    )
    .unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(
        t.render(&[ChatMessage::user("hi")], true).unwrap(),
        "<s>HI</s>"
    );
}

#[test]
fn chat_template_jinja_alone_is_enough() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}]{{ m.content.strip() }}{% endfor %}",
    )
    .unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(
        t.render(&[ChatMessage::user(" hi ")], true).unwrap(),
        "[user]hi"
    );
}

#[test]
fn a_looping_template_runs_out_of_fuel_with_a_clear_error() {
    let t = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        None,
        None,
    );
    let e = t.render(&[ChatMessage::user("hi")], true).unwrap_err();
    assert!(matches!(e, ChatError::OutOfFuel), "{e}");
    assert!(e.to_string().contains("fewer or shorter messages"), "{e}");
}

#[test]
fn a_rendered_prompt_over_the_cap_is_refused() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        None,
        None,
    );
    let big = "x".repeat(MAX_RENDERED_BYTES / 4 + 1);
    let msgs: Vec<ChatMessage> = (0..4).map(|_| ChatMessage::user(&big)).collect();
    let e = t.render(&msgs, true).unwrap_err();
    assert!(matches!(e, ChatError::TooLong), "{e}");
    let ok = t.render(&msgs[..3], true).unwrap();
    assert_eq!(ok.len(), 3 * big.len());
}
