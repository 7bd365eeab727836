-- mmgeo gallery in PostgreSQL + pgvector, schema version 1 (docs/design.md §11).
-- One gallery per PostgreSQL schema (the connection's search_path; `public` by default). Applied once, in a
-- transaction, by mmgeo.search.database.migrate, which records it in mmgeo_schema_version.
CREATE EXTENSION IF NOT EXISTS vector;

-- The gallery itself: its manifest (model record with the checkpoint's SHA-256, dimensions, the re-rank store's
-- codec and codebook records) and its image count, kept by every write in the same transaction.
CREATE TABLE mmgeo_gallery (
    id          smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    manifest    jsonb NOT NULL,
    image_count bigint NOT NULL DEFAULT 0 CHECK (image_count >= 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- One quantizer per (role, head): a FAISS index serialised to bytes, and its SHA-256 (checked on load against
-- the bytes and against the manifest's record).
CREATE TABLE mmgeo_codebooks (
    role   text NOT NULL CHECK (role IN ('keys', 'values')),
    head   integer NOT NULL CHECK (head >= 0),
    data   bytea NOT NULL,
    sha256 text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    PRIMARY KEY (role, head)
);

CREATE SEQUENCE mmgeo_image_ids AS bigint MINVALUE 0 START WITH 0;

-- One row per image. `embedding` gets its dimension (vector(d_global)) and its HNSW index (inner product) when a
-- gallery is created, the one statement whose text depends on the model.
CREATE TABLE mmgeo_images (
    id             bigint PRIMARY KEY DEFAULT nextval('mmgeo_image_ids'),
    content_sha256 bytea NOT NULL UNIQUE CHECK (length(content_sha256) = 32),
    meta           jsonb NOT NULL,
    embedding      vector NOT NULL,
    key_codes      bytea NOT NULL,   -- (H, L, code_size) uint8 codes, or (H, L, d_a) fp16 for the fp16 codec
    value_codes    bytea NOT NULL,   -- (H, L, code_size) uint8 codes, or (H, L, d_e) fp16
    mask           bytea,            -- packed bits of the L stored patches that are real; NULL: all are
    patches        bytea,            -- packed bits of the S grid patches a pruned store kept; NULL: all
    file           bytea,            -- the image file, when the gallery keeps it (generated or uploaded images)
    added_at       timestamptz NOT NULL DEFAULT now()
);
ALTER SEQUENCE mmgeo_image_ids OWNED BY mmgeo_images.id;
