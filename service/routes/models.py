from __future__ import annotations

from fastapi import APIRouter

from embgeom.errors import ModelLoadError
from service.deps import RuntimeDep
from service.schemas import ModelOut

router = APIRouter(prefix="/v1", tags=["models"])


@router.get("/models", response_model=list[ModelOut])
def list_models(rt: RuntimeDep) -> list[dict]:
    """The configured aliases; ``loaded`` is true when a live worker holds the model."""
    loaded = {m for w in rt.live_workers()
              for m in w.get("loaded", [])}
    out = []
    for name, info in rt.registry.infos(rt.registry.names()).items():
        source = rt.registry.source(name).source
        if isinstance(info, ModelLoadError):
            out.append({"name": name, "source": source, "architecture": None, "num_layers": None,
                        "hidden_size": None, "vocab_size": None, "loaded": False,
                        "available": False, "error": info.message})
            continue
        out.append({"name": name, "source": source, "architecture": info.architecture,
                    "num_layers": info.num_layers, "hidden_size": info.hidden_size,
                    "vocab_size": info.vocab_size, "max_length": info.max_length,
                    "loaded": name in loaded, "available": True})
    return out
