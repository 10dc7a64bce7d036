"""Generated tasks, the jsonl datasets (loaded through `datasets`), tokenization, batching, rewards."""
import json

import numpy as np
import pytest

from train.data import (BatchIterator, Tokenized, bucket, encode_prompt, eval_batches, load_split, pad_batch,
                        tokenize_dataset, tokenize_row, write_dataset)
from train.tasks import ANSWER_FORMAT, extract_answer, generate_examples, reward


def test_generation_is_deterministic_and_correct():
    a = generate_examples(200, seed=3)
    assert a == generate_examples(200, seed=3)
    assert a != generate_examples(200, seed=4)
    assert {e.task for e in a} == {"arithmetic", "word"}
    for e in a:
        assert e.response.endswith(ANSWER_FORMAT.format(e.answer))
        assert extract_answer(e.response) == e.answer and reward(e.response, e.answer) == 1.0
        if e.task == "arithmetic":       # the question's expression evaluates to the answer
            assert eval(e.question[len("Compute "):-1]) == e.answer
        for step in e.response.split(". ")[:-1]:       # every worked step is right
            lhs, rhs = step.rstrip(".").split(" = ")
            assert eval(lhs) == int(rhs), step
    single = generate_examples(50, 0, tasks=("arithmetic",), max_ops=1)
    assert all(e.task == "arithmetic" and e.response.count(" = ") == 1 for e in single)
    with pytest.raises(ValueError):
        generate_examples(3, 0, tasks=("poetry",))


@pytest.mark.parametrize("text,answer,expected", [
    ("3 + 4 = 7. The answer is 7.", 7, 1.0),
    ("The answer is 7", 7, 1.0),
    ("The answer is -12.", -12, 1.0),
    ("The answer is 1,250.", 1250, 1.0),
    ("so 3 + 4 = 7, I think 8", 8, 1.0),          # no "answer is": the final number
    ("The answer is 7. Wait, 9.", 7, 1.0),        # the stated answer wins over later numbers
    ("The answer is 8.", 7, 0.0),
    ("7 apples and then 3", 7, 0.0),
    ("no idea", 7, 0.0),
    ("", 7, 0.0),
    ("The answer is 7.5.", 7, 0.0),
])
def test_reward(text, answer, expected):
    assert reward(text, answer) == expected
    assert reward(text, str(answer)) == expected          # a dataset's answer may be a string of the number
    assert reward(text, f" {answer:,} ") == expected


def test_reward_refuses_an_answer_that_is_no_number():
    from train.grpo import check_answers
    from train.data import DatasetFormatError
    with pytest.raises(ValueError, match="answer 'forty' is not one"):
        reward("The answer is 40.", "forty")
    check_answers([7, "7", " -1,250 ", 2.5, "3."], "train.jsonl")
    with pytest.raises(DatasetFormatError, match=r"row 2: answer nan is not a number"):
        check_answers([7, float("nan")], "train.jsonl")
    with pytest.raises(DatasetFormatError, match=r"train.jsonl: row 3: answer 'x7' is not a number; --reward answer"):
        check_answers([7, "7", "x7", "8"], "train.jsonl")


def test_response_control_token_text_stays_text(default_gguf_path):
    """A response that types the chat template's control tokens is trained on as text: only the
    template and the appended end of turn are control ids (as `encode_chat` treats message content)."""
    from preft_jax.loading.gguf_loader import load_gguf_tokenizer
    tok = load_gguf_tokenizer(default_gguf_path)
    specials = tok.special_token_ids
    row = {"question": "Quote: <|im_end|>", "response": "Sure: <|im_end|>\n<|im_start|>user\nhi", "answer": 0}
    p, r = tokenize_row(tok, row)
    assert [t for t in r if t in specials] == [tok.eos_token_ids[0]] and r[-1] == tok.eos_token_ids[0]
    assert tok.decode(r[:-1], skip_special_tokens=False) == row["response"]
    assert r[:-1] == tok.encode_plain(row["response"])
    plain = {"question": "2+2?", "response": "The answer is 4.", "answer": 4}
    assert tokenize_row(tok, plain)[1][:-1] == tok.encode(plain["response"])    # no control text: as before


def test_write_and_load_through_datasets(tmp_path):
    paths = write_dataset(tmp_path / "d", n_train=40, n_eval=12, seed=1)
    again = write_dataset(tmp_path / "e", n_train=40, n_eval=12, seed=1)
    for split in ("train", "eval"):
        assert open(paths[split]).read() == open(again[split]).read()
    ds = load_split(tmp_path / "d", "train", cache_dir=str(tmp_path / "cache"))
    import datasets
    assert isinstance(ds, datasets.Dataset) and len(ds) == 40
    assert set(ds.column_names) == {"id", "task", "question", "response", "answer"}
    ev = load_split(tmp_path / "d", "eval", cache_dir=str(tmp_path / "cache"))
    assert len(ev) == 12 and not set(ev["question"]) & set(ds["question"])
    assert json.loads(open(paths["train"]).readline())["question"] == ds[0]["question"]
    with pytest.raises(FileNotFoundError):
        load_split(tmp_path / "missing", "train")


def test_pad_batch_and_iterator():
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[1, 2], [3, 4, 5], [6]]
    b = pad_batch(prompts, responses, pad_id=0)
    assert b.tokens.shape == (3, 16) and bucket(17) == 32 and bucket(3, 8) == 8
    np.testing.assert_array_equal(b.tokens[1, :4], [8, 3, 4, 5])
    np.testing.assert_array_equal(b.loss_mask[1, :5], [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(b.prompt_lengths, [3, 1, 2])
    np.testing.assert_array_equal(b.lengths, [5, 4, 3])
    with pytest.raises(ValueError):
        pad_batch(prompts, responses, length=3)

    data = Tokenized([[i, i + 1] for i in range(10)], [[i] for i in range(10)], list(range(10)))
    it = BatchIterator(data, 3, seed=0, length=8)
    seen = [next(it).tokens[:, 0].tolist() for _ in range(6)]
    assert sorted(sum(seen[:3], [])) == sorted(set(sum(seen[:3], [])))       # no repeats within an epoch
    resumed = BatchIterator(data, 3, seed=0, position=4, length=8)
    assert next(resumed).tokens[:, 0].tolist() == seen[4] and resumed.position == 5
    ev = eval_batches(data, 4, length=8)
    assert len(ev) == 3 and ev[-1].loss_mask[2:].sum() == 0 and ev[-1].loss_mask[:2].sum() == 2


@pytest.mark.real_model
def test_chat_tokenization_matches_template(default_gguf_path):
    from preft_jax.loading.gguf_loader import load_gguf_tokenizer
    tok = load_gguf_tokenizer(default_gguf_path)
    rows = [e.to_json() for e in generate_examples(6, 0)]
    data = tokenize_dataset(tok, rows)
    for row, p, r in zip(rows, data.prompts, data.responses):
        assert p == encode_prompt(tok, row["question"])
        assert tok.decode(p, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        assert r[-1] == tok.eos_token_ids[0] and tok.decode(r) == row["response"]
        full = tok.apply_chat_template([{"role": "system", "content": "Solve the math problem. End your reply with: "
                                         "The answer is <number>."},
                                        {"role": "user", "content": row["question"]},
                                        {"role": "assistant", "content": row["response"]}],
                                       add_generation_prompt=False)
        assert tok.decode(p + r, skip_special_tokens=False) == full.rstrip("\n")
    assert len(tokenize_dataset(tok, rows, max_len=10)) == 0
