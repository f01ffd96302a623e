"""The data layer: tokenizers, sources, formats, samplers, collators and the LightningDataModule.

Public names are importable from here so configs can say ``class_path: lit_ablate.data.LMDataModule``.
"""

from lit_ablate.data.arithmetic_preference import ArithmeticPreference
from lit_ablate.data.collate import Collator, PaddingCollator
from lit_ablate.data.datamodule import ExampleDataset, LMDataModule
from lit_ablate.data.formats import Example, build_examples, example_from_tokens
from lit_ablate.data.mds_source import MDSShards
from lit_ablate.data.packing import PackedSampler, PackingCollator, pack, pack_ffd, pack_greedy
from lit_ablate.data.preference_collate import PreferencePackingCollator, PreferencePaddingCollator
from lit_ablate.data.sampler import ShardedSampler, Sharding
from lit_ablate.data.sources import ArithmeticSFT, DataSource, HubDataset, LocalFiles, SyntheticText
from lit_ablate.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ArithmeticPreference",
    "ArithmeticSFT",
    "ByteTokenizer",
    "Collator",
    "DataSource",
    "Example",
    "ExampleDataset",
    "HFTokenizer",
    "HubDataset",
    "LMDataModule",
    "LocalFiles",
    "MDSShards",
    "PackedSampler",
    "PackingCollator",
    "PaddingCollator",
    "PreferencePackingCollator",
    "PreferencePaddingCollator",
    "ShardedSampler",
    "Sharding",
    "SyntheticText",
    "Tokenizer",
    "build_examples",
    "example_from_tokens",
    "load_tokenizer",
    "pack",
    "pack_ffd",
    "pack_greedy",
]
