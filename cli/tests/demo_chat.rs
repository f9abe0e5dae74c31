//! Chat templates rendered as Hugging Face renders them: the real SmolLM2
//! template (from the cached GGUF, when present), a synthetic template that
//! leans on Jinja's whitespace rules, random message contents, and clear
//! errors for templates that cannot be used.
//!
//! Expected strings were produced by Jinja2 3.1.6 with the environment
//! transformers uses (`ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)`, `raise_exception` as a global).

use kiln_compiler::gguf::GgufFile;
use kiln_compiler::testing::smollm2_gguf_for_tests;
use kiln_compiler::tokenizer_build::build_tokenizer;
use kiln_runtime::chat::{ChatError, ChatMessage, ChatTemplate};
use proptest::prelude::*;

#[test]
fn smollm2_template_renders_chatml_with_its_own_default_system_prompt() {
    let Some(path) = smollm2_gguf_for_tests() else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    let built = build_tokenizer(&g, Some(8192)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string(&built.tokenizer_config).unwrap(),
    )
    .unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(t.eos_token.as_deref(), Some("<|im_end|>"));

    let plain = t
        .render(&[ChatMessage::user("What is 2+2?")], true)
        .unwrap();
    assert_eq!(
        plain,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let with_system = t
        .render(
            &[
                ChatMessage::system("You are terse."),
                ChatMessage::user("What is 2+2?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        with_system,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );

    // The control tokens survive tokenization as single ids: <|im_start|> is
    // 1 and <|im_end|> (the model's EOS) is 2.
    let tok: tokenizers::Tokenizer = built.tokenizer_json.parse().unwrap();
    let ids = tok.encode(plain.as_str(), true).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
}

const SYNTHETIC: &str = "{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'system' and not loop.first %}
    {{ raise_exception('the system message must come first') }}
  {% endif %}
[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
";

#[test]
fn synthetic_template_follows_jinja2_whitespace_rules_and_special_tokens() {
    let t = ChatTemplate::new(SYNTHETIC, Some("<s>"), Some("</s>"));
    let msgs = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi  there\n  friend"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<s>\n[SYSTEM] Be brief.</s>\n[USER] Hi  there\n  friend</s>\n[ASSISTANT]\n"
    );
    assert_eq!(
        t.render(&msgs[1..], false).unwrap(),
        "<s>\n[USER] Hi  there\n  friend</s>\n"
    );
}

#[test]
fn a_template_that_raises_is_a_render_error_carrying_its_message() {
    let t = ChatTemplate::new(SYNTHETIC, Some("<s>"), Some("</s>"));
    let err = t
        .render(
            &[ChatMessage::user("hi"), ChatMessage::system("late")],
            true,
        )
        .unwrap_err();
    assert!(matches!(err, ChatError::Render(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("the system message must come first"),
        "{err}"
    );
}

#[test]
fn unusable_templates_and_configs_are_clear_errors() {
    let err = ChatTemplate::new("{% for m in messages %}", None, None)
        .render(&[ChatMessage::user("hi")], true)
        .unwrap_err();
    assert!(matches!(err, ChatError::Syntax(_)), "{err:?}");

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tokenizer_config.json");
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ChatError::Io { .. }), "{err:?}");

    std::fs::write(&cfg, r#"{"eos_token": "</s>"}"#).unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ChatError::NoTemplate { .. }), "{err:?}");
    assert!(err.to_string().contains("kiln run --prompt"), "{err}");

    std::fs::write(&cfg, "{not json").unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ChatError::Json { .. }), "{err:?}");

    std::fs::write(
        &cfg,
        r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#,
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("named `default`"), "{err}");
}

#[test]
fn a_named_default_template_and_object_special_tokens_are_read() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "rag", "template": "RAG"},
                              {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
            "bos_token": {"content": "<B>", "special": true}}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(t.eos_token, None);
    assert_eq!(t.render(&[ChatMessage::user("q")], true).unwrap(), "<B>q");
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
                      message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
                      {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Message contents are data, never template syntax: random text
    /// (braces, percent signs, newlines, non-ASCII included) comes out
    /// exactly as ChatML frames it.
    #[test]
    fn random_contents_render_verbatim_in_chatml(
        turns in proptest::collection::vec(
            (prop_oneof![Just("system"), Just("user"), Just("assistant")],
             "[a-zA-Z0-9 {}%#\n\té€😀<>|'\"]{0,40}"),
            1..6),
        gen in any::<bool>(),
    ) {
        let msgs: Vec<ChatMessage> =
            turns.iter().map(|(r, c)| ChatMessage::new(r, c)).collect();
        let mut want: String = msgs
            .iter()
            .map(|m| format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content))
            .collect();
        if gen {
            want.push_str("<|im_start|>assistant\n");
        }
        let got = ChatTemplate::new(CHATML, None, None).render(&msgs, gen).unwrap();
        prop_assert_eq!(got, want);
    }
}

#[test]
fn gemma3_270m_template_renders_a_question_answer_transcript() {
    let t = ChatTemplate::new(kiln_cli::demo::GEMMA3_270M_TEMPLATE, Some("<bos>"), None);
    let plain = t
        .render(&[ChatMessage::user(" What is 2+2? ")], true)
        .unwrap();
    assert_eq!(plain, "Q: What is 2+2?\nA:");
    let chat = t
        .render(
            &[
                ChatMessage::system("Answer briefly."),
                ChatMessage::user("Hi"),
                ChatMessage::new("assistant", "Hello."),
                ChatMessage::user("2+2?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(chat, "Answer briefly.\nQ: Hi\nA: Hello.\nQ: 2+2?\nA:");
}
