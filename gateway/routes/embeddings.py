"""OpenAI's Embeddings API: one route onto the frontend's Embed RPC."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.client import FrontendClient, until_disconnected
from gateway.convert import embeddings_request_to_proto
from gateway.extra_fields import check_extra_fields
from gateway.openapi import GENERATION_ERRORS, responses
from gateway.render.openai import embedding_list_to_dict
from gateway.responses import EmbeddingList
from gateway.schemas import EmbeddingsBody

router = APIRouter(tags=["openai"])


@router.post(
    "/v1/embeddings",
    response_model=None,
    responses=responses(EmbeddingList, "An embedding list, in input order.", GENERATION_ERRORS),
)
async def create_embeddings(body: EmbeddingsBody, request: Request) -> dict[str, Any]:
    """Embed each input: the model's final hidden states pooled (the frontend's
    --pooling) and L2-normalised."""
    client: FrontendClient = request.state.frontend
    rid: str = request.state.request_id
    check_extra_fields(body)
    proto = embeddings_request_to_proto(body, rid)
    call = client.stub.Embed(proto, **client.options(rid))
    return embedding_list_to_dict(await until_disconnected(request, call, call))
