"""`/v1/models`: upload an ONNX model (its task table comes back), list and read models."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Path, UploadFile

from services.api import crud
from services.api.deps import IntakeDep, PageDep, SessionsDep, SettingsDep, TeamDep
from services.api.exceptions import PayloadTooLarge
from services.api.intake import IntakeLimits, accept_upload
from services.api.routers.responses import AUTH, errors
from services.api.schemas import ModelPage, ModelPublic
from services.db import uploads
from services.db.session import transaction

router = APIRouter(prefix="/v1/models", tags=["models"], responses=AUTH)


@router.post("", status_code=201, responses=errors(400, 413, 429), summary="Upload an ONNX model")
def upload_model(
    team: TeamDep,
    sessions: SessionsDep,
    settings: SettingsDep,
    intake: IntakeDep,
    file: Annotated[UploadFile, File(description="the ONNX model file")],
    input_shapes: Annotated[
        str, Form(description='JSON object {"input name": [d0, d1, ...]}, needed for inputs with dynamic dimensions')
    ] = "{}",
    name: Annotated[str | None, Form(max_length=100, description="default: the file name's stem")] = None,
    external_data: Annotated[
        list[UploadFile],
        File(
            description="the model's external data files (weights it keeps outside the .onnx), one part each, "
            "named by the location the model gives it (e.g. model.onnx.data, weights/w0.bin)"
        ),
    ] = [],  # noqa: B006 (FastAPI copies defaults)
) -> ModelPublic:
    """Import the model with fixed input shapes, fuse it and list its tuning tasks. A
    malformed or unsupported model is a 422 naming the operator; so is external data the
    model names outside its own directory (naming the tensor and the location), or that
    did not come with it, and a tensor with more elements than the farm allows (naming
    it). Nothing is stored then. A team imports a limited number of models at once: one
    more meanwhile is a 429 (try again after `Retry-After`)."""
    total = sum(f.size or 0 for f in (file, *external_data))
    if total > settings.max_upload_bytes:
        raise PayloadTooLarge(f"the model is larger than this farm accepts ({settings.max_upload_bytes} bytes)")
    limits = IntakeLimits(
        max_bytes=settings.max_upload_bytes,
        timeout_secs=settings.intake_timeout_secs,
        max_tensor_elements=settings.max_tensor_elements,
        max_model_elements=settings.max_model_elements,
    )
    with intake.admit(team.id):
        taken = accept_upload(
            intake,
            upload=file.file,
            filename=file.filename,
            name=name,
            input_shapes_text=input_shapes,
            root=settings.artifact_root,
            limits=limits,
            external_data=[(f.filename, f.file) for f in external_data],
        )
    with transaction(sessions) as db:
        model = uploads.store_model(
            db,
            team_id=team.id,
            name=taken.name,
            input_shapes=taken.input_shapes,
            onnx=taken.onnx,
            fused=taken.fused,
            intake=taken.intake,
        )
        return crud.model_public(model)


@router.get("", summary="List your team's models, newest first")
def list_models(team: TeamDep, sessions: SessionsDep, page: PageDep) -> ModelPage:
    with transaction(sessions) as db:
        items, next_cursor = crud.list_models(db, team_id=team.id, limit=page.limit, cursor=page.cursor)
    return ModelPage(items=items, next_cursor=next_cursor)


@router.get("/{model_id}", responses=errors(404), summary="A model and its task table")
def get_model(model_id: Annotated[int, Path(ge=1)], team: TeamDep, sessions: SessionsDep) -> ModelPublic:
    with transaction(sessions) as db:
        return crud.model_public(crud.get_model(db, team_id=team.id, model_id=model_id))
