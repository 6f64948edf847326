"""Turn a model argument into a local folder: a folder as given, or a Hugging Face Hub snapshot."""

from __future__ import annotations

import os

# What a snapshot needs: configs, tokenizer files and weights (safetensors preferred, .bin kept
# as a fallback only when a repo has no safetensors).
_CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Return a local folder for `model`: the folder itself, or a downloaded Hub snapshot."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file; pass the folder that holds config.json and the weights.")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model folder {model!r} does not exist.")
    return _download(model, revision, download_dir)


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        files = HfApi().list_repo_files(repo_id, revision=revision)
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=_CONFIG_AND_TOKENIZER + weights)
    except Exception as e:  # offline, unreachable, unknown repo, no access: the HTTP errors vary
        # A previously downloaded snapshot still works.
        try:
            return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True)
        except (LocalEntryNotFoundError, OSError):
            raise ValueError(
                f"model {repo_id!r} is not a local folder and could not be fetched from the "
                f"Hugging Face Hub ({type(e).__name__}: {e}). Pass a local checkpoint folder, or "
                f"check the repo id and the network.") from e
