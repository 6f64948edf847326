"""Turn a model argument into a local path: a checkpoint folder or a .gguf file as given, a Hugging
Face Hub snapshot of a repo id, or one .gguf file of a Hub repo (`owner/repo/file.gguf`)."""

from __future__ import annotations

import os

# What a snapshot needs: configs, tokenizer files and weights (safetensors preferred, .bin kept
# as a fallback only when a repo has no safetensors).
_CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
GGUF_SUFFIX = ".gguf"


def is_gguf(path: str) -> bool:
    """Whether a model path names a GGUF file (rather than a checkpoint folder)."""
    return path.lower().endswith(GGUF_SUFFIX)


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Return a local folder or .gguf file for `model`: the path itself, or a Hub download."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if os.path.isfile(model):
        if is_gguf(model):
            return os.path.abspath(model)
        raise ValueError(f"model {model!r} is a file; pass a .gguf file or the folder that holds "
                         f"config.json and the weights.")
    local = model.startswith((".", "/", "~"))
    if is_gguf(model):
        if local or model.count("/") != 2:
            raise ValueError(f"model file {model!r} does not exist (a GGUF file on the Hub is named "
                             f"owner/repo/file.gguf).")
        repo_id, filename = model.rsplit("/", 1)
        return _download_file(repo_id, filename, revision, download_dir)
    if local or model.count("/") > 1:
        raise ValueError(f"model folder {model!r} does not exist.")
    return _download(model, revision, download_dir)


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        files = HfApi().list_repo_files(repo_id, revision=revision)
        if any(f.endswith((".safetensors", ".bin")) for f in files) or not any(map(is_gguf, files)):
            weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
            return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                     allow_patterns=_CONFIG_AND_TOKENIZER + weights)
    except Exception as e:  # offline, unreachable, unknown repo, no access: the HTTP errors vary
        # A previously downloaded snapshot still works.
        try:
            return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True)
        except (LocalEntryNotFoundError, OSError):
            raise _unreachable(repo_id, e) from e
    ggufs = [f for f in files if is_gguf(f)]
    raise ValueError(f"Hub repo {repo_id!r} holds GGUF files, not a checkpoint; pass one of them as "
                     f"{repo_id}/FILE.gguf: {', '.join(ggufs[:8])}" + (" ..." if len(ggufs) > 8 else ""))


def _download_file(repo_id: str, filename: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir)
    except Exception as e:  # offline or unreachable: a cached copy still works
        try:
            return hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir,
                                   local_files_only=True)
        except Exception:
            raise _unreachable(f"{repo_id}/{filename}", e) from e


def _unreachable(name: str, error: Exception) -> ValueError:
    return ValueError(
        f"model {name!r} is not a local path and could not be fetched from the Hugging Face Hub "
        f"({type(error).__name__}: {error}). Pass a local checkpoint folder or .gguf file, or "
        f"check the repo id and the network.")
