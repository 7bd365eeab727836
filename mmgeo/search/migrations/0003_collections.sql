-- mmgeo gallery schema version 3 (docs/design.md §12): collections, row-level security, API keys.
-- Every gallery row belongs to one collection. The collection of a transaction is the setting mmgeo.collection,
-- which the service sets per transaction from the request's key (set_config(..., true): SET LOCAL); unset, it is
-- 'default' (a database of one gallery, as before). Row-level security, forced on the tables' owner too, lets a
-- role see and write only the current collection's rows, whatever WHERE a query has. A superuser or a role with
-- BYPASSRLS sees every row: the service must connect as neither (docs/serve.md, "Keys and collections").

CREATE FUNCTION mmgeo_collection() RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT coalesce(nullif(current_setting('mmgeo.collection', true), ''), 'default') $$;

ALTER TABLE mmgeo_gallery ADD COLUMN collection text NOT NULL DEFAULT mmgeo_collection();
ALTER TABLE mmgeo_gallery DROP CONSTRAINT mmgeo_gallery_pkey;
ALTER TABLE mmgeo_gallery ADD PRIMARY KEY (collection, id);

ALTER TABLE mmgeo_codebooks ADD COLUMN collection text NOT NULL DEFAULT mmgeo_collection();
ALTER TABLE mmgeo_codebooks DROP CONSTRAINT mmgeo_codebooks_pkey;
ALTER TABLE mmgeo_codebooks ADD PRIMARY KEY (collection, role, head);

-- ids stay unique in the database (one sequence) but mean something only inside their collection; the same file
-- may be in two collections
ALTER TABLE mmgeo_images ADD COLUMN collection text NOT NULL DEFAULT mmgeo_collection();
ALTER TABLE mmgeo_images DROP CONSTRAINT mmgeo_images_content_sha256_key;
ALTER TABLE mmgeo_images ADD CONSTRAINT mmgeo_images_collection_sha256 UNIQUE (collection, content_sha256);
CREATE INDEX mmgeo_images_collection ON mmgeo_images (collection);

ALTER TABLE mmgeo_build_rows ADD COLUMN collection text NOT NULL DEFAULT mmgeo_collection();

DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['mmgeo_gallery', 'mmgeo_codebooks', 'mmgeo_images', 'mmgeo_build_rows'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY mmgeo_collection ON %I USING (collection = mmgeo_collection()) '
                       'WITH CHECK (collection = mmgeo_collection())', t);
    END LOOP;
END $$;

-- API keys of the service (serve.auth): hashes only. Not under row-level security: a key is looked up by its id
-- before its collection is known. The service's role needs SELECT and UPDATE (used_bytes, used_images) on it.
CREATE TABLE mmgeo_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{12}$'),
    collection   text NOT NULL,
    scope        text NOT NULL CHECK (scope IN ('read', 'write', 'admin')),
    salt         text NOT NULL,
    hash         text NOT NULL,
    iterations   integer NOT NULL CHECK (iterations > 0),
    name         text NOT NULL DEFAULT '',
    created      double precision NOT NULL,
    revoked      double precision,
    rate         integer NOT NULL CHECK (rate >= 0),
    quota_bytes  bigint NOT NULL CHECK (quota_bytes >= 0),
    quota_images bigint NOT NULL CHECK (quota_images >= 0),
    used_bytes   bigint NOT NULL DEFAULT 0 CHECK (used_bytes >= 0),
    used_images  bigint NOT NULL DEFAULT 0 CHECK (used_images >= 0)
);
