-- mmgeo gallery schema version 2 (docs/design.md §11): the staging rows of a build over several processes.
-- Each rank COPYs the images it encoded here (one transaction per batch, keyed by the image's position in the
-- build's list); rank 0 then moves them into mmgeo_images in that order, one transaction per chunk, and deletes
-- them here in the same transaction. Readers never look at this table. UNLOGGED: a server crash empties it, and
-- the build restarted encodes those images again.
CREATE UNLOGGED TABLE mmgeo_build_rows (
    ord            integer PRIMARY KEY CHECK (ord >= 0),
    content_sha256 bytea NOT NULL CHECK (length(content_sha256) = 32),
    meta           jsonb NOT NULL,
    embedding      vector NOT NULL,
    key_codes      bytea NOT NULL,
    value_codes    bytea NOT NULL,
    mask           bytea,
    patches        bytea,
    file           bytea
);
