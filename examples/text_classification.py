"""Text classification on a datasets.Dataset: tokenizer, dynamic padding, accuracy, early stopping, predictions.

The README's recipe for one's own project, as a job. With no flags it runs offline: a small sentiment set made here
(short English sentences, labels 0/1; about 700 train / 100 validation / 100 test), a word-level tokenizer
trained on it, and a small BERT built from a config. Each sentence is tokenised to its own length, and
``DataCollatorWithPadding`` pads each batch to its longest; ``metrics_fn`` adds ``eval_accuracy``; ``EarlyStopping``
stops when it stalls and ``keep_best`` keeps the best checkpoint; ``predict()`` labels the test split.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/text_classification.py
    python examples/text_classification.py
    python examples/text_classification.py --pad-to-max-length    # fixed-length rows, no collate_fn

From the Hub (a pretrained encoder and its tokenizer; the split names and columns of that data set):

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/text_classification.py \
        --dataset-name stanfordnlp/sst2 --text-column sentence --model-name google-bert/bert-base-uncased \
        --eval-split validation --test-split validation --lr 2e-5 --epochs 3

Every TrainConfig field is a flag too (``--lr``, ``--batch-size``, ``--eval-every``).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# trainer before the libraries: it quiets what they say at import that no user can act on (torchao's).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from trainer import EarlyStopping, TrainConfig, Trainer, distributed_state  # noqa: E402

# isort: split
import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
)

EXAMPLE_DEFAULTS = dict(
    output_dir="runs/text_classification",
    experiment_name="text-classification",
    epochs=10,
    batch_size=16,
    lr=1e-3,
    eval_every=20,
    save_every=20,
    keep_last=1,
    keep_best="eval_accuracy",
    keep_best_mode="max",
    log_every=10,
)


@dataclass
class ClassifierArgs:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "a datasets hub name (default: built-in)"})
    dataset_config: Optional[str] = None
    text_column: str = "text"
    label_column: str = "label"
    train_split: str = "train"
    eval_split: str = "validation"
    test_split: str = "test"
    model_name: Optional[str] = field(default=None, metadata={"help": "hub name or path of an encoder"})
    max_length: int = 128
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "pad every text to max_length when tokenising, "
            "and pass no collate_fn: the Trainer formats the columns as tensors"
        },
    )
    patience: int = 2  # evaluations without a better eval_accuracy before stopping


def sentiment_data(seed: int = 0):
    """A DatasetDict of short sentences whose label (1 positive, 0 negative) the adjective and a "not" decide."""
    from datasets import Dataset, DatasetDict

    good = ["good", "great", "wonderful", "fine", "lovely", "excellent", "pleasant", "superb"]
    bad = ["bad", "awful", "terrible", "poor", "dull", "horrible", "boring", "weak"]
    subjects = ["the film", "this book", "the food", "our trip", "the music", "that show", "the service", "the plot"]
    rng = random.Random(seed)
    rows = {"text": [], "label": []}
    for _ in range(900):
        positive, negated = rng.random() < 0.5, rng.random() < 0.3
        adjective = rng.choice(good if positive != negated else bad)
        adverb = rng.choice(["", "really ", "quite ", "very very "])
        rows["text"].append(f"{rng.choice(subjects)} was {'not ' if negated else ''}{adverb}{adjective}")
        rows["label"].append(int(positive))
    data = Dataset.from_dict(rows)
    return DatasetDict(
        train=data.select(range(700)), validation=data.select(range(700, 800)), test=data.select(range(800, 900))
    )


def word_tokenizer(texts):
    """A word-level tokenizer trained on ``texts``, BERT's way round: [CLS] words [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    vocabulary = trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False)
    words.train_from_iterator(texts, vocabulary)
    specials = [(token, words.token_to_id(token)) for token in ("[CLS]", "[SEP]")]
    words.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )


def accuracy(model, batch) -> dict[str, torch.Tensor]:
    """One number per example, so evaluate()'s mean counts each example once whatever the process count."""
    return {"accuracy": (model(**batch).logits.argmax(-1) == batch["labels"]).float()}


def main(argv=None) -> dict:
    parser = HfArgumentParser([ClassifierArgs, TrainConfig])
    parser.set_defaults(**EXAMPLE_DEFAULTS)
    args, config = parser.parse_args_into_dataclasses(args=argv)
    state = distributed_state(config.collective_timeout_s)
    datasets.disable_progress_bars()  # a bar per map per process, for milliseconds of work: noise in the log
    with state.main_process_first():  # one process downloads / tokenises; the others read its cache
        if args.dataset_name:
            data = datasets.load_dataset(args.dataset_name, args.dataset_config)
        else:
            data = sentiment_data(config.seed)
        if args.text_column != "text":
            data = data.rename_column(args.text_column, "text")
        if args.label_column != "label":
            data = data.rename_column(args.label_column, "label")
        if args.model_name:
            tokenizer = AutoTokenizer.from_pretrained(args.model_name)
        else:
            tokenizer = word_tokenizer(data[args.train_split]["text"])
        # Each text to its own length: DataCollatorWithPadding pads every batch to its longest. The "text" column
        # stays; the Trainer leaves out what the model's forward does not take.
        padding = "max_length" if args.pad_to_max_length else False
        data = data.map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.max_length, padding=padding),
            batched=True,
        )
    collate_fn = None if args.pad_to_max_length else DataCollatorWithPadding(tokenizer)

    num_labels = len(set(data[args.train_split]["label"]))
    torch.manual_seed(config.seed)
    if args.model_name:
        model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=num_labels)
    else:
        model = BertForSequenceClassification(
            BertConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=args.max_length,
                num_labels=num_labels,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    trainer = Trainer(
        model,
        config,
        train_data=data[args.train_split],
        eval_data=data[args.eval_split],
        metrics_fn=accuracy,
        collate_fn=collate_fn,
        callbacks=[EarlyStopping("eval_accuracy", mode="max", patience=args.patience)],
    )
    result = trainer.fit()

    test = data[args.test_split]
    predicted = trainer.predict(test, lambda model, batch: model(**batch).logits.argmax(-1))  # in dataset order
    test_accuracy = (predicted == torch.tensor(test["label"])).float().mean().item()
    trainer.accelerator.print(
        f"text_classification | eval accuracy {result['eval_accuracy']:.3f} at step {result['global_step']}"
        f" ({'stopped early' if result['stopped'] else 'ran to the end'}); best checkpoint {trainer.best_checkpoint}\n"
        f"text_classification | test accuracy {test_accuracy:.3f} over {len(predicted)} predictions; "
        f"first: {test[0]['text']!r} -> {predicted[0].item()}"
    )
    return {**result, "test_accuracy": test_accuracy}


if __name__ == "__main__":
    main()
