"""compact layouts: gpus.pos, and layout versions stored as compact bodies (keyframes and deltas)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

Every GPU gets a stable position (`gpus.pos`, unique, never reused; existing GPUs are numbered in
(domain, node, index) order, new ones get the next number at registration). A layout version is
stored as a compact body (store/layout_codec.py) that names GPUs by position: a keyframe
(`base_version` NULL) or a delta on the version before it. `plan` (the full plan JSON) becomes
optional.

Existing versions are converted to keyframes. A version that cannot be converted (a GPU it names
is no longer in the gpus table, or a document the codec cannot read) keeps its plan JSON, and the
manager reads it as it did before. Downgrade writes every version's plan JSON back.
"""

import sqlalchemy as sa
from alembic import op

from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.planner.spec import PlanError
from ntp_manager.store import layout_codec as codec

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

gpus = sa.table('gpus', sa.column('uuid', sa.String), sa.column('pos', sa.Integer), sa.column('domain_id', sa.String),
                sa.column('node', sa.String), sa.column('idx', sa.Integer))
layouts = sa.table('layouts', sa.column('id', sa.Integer), sa.column('job', sa.String),
                   sa.column('version', sa.BigInteger), sa.column('plan', sa.JSON),
                   sa.column('body', sa.LargeBinary), sa.column('base_version', sa.BigInteger))


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pos', sa.Integer(), nullable=True))
    uuids = bind.execute(sa.select(gpus.c.uuid).order_by(gpus.c.domain_id, gpus.c.node, gpus.c.idx)).scalars().all()
    if uuids:
        bind.execute(gpus.update().where(gpus.c.uuid == sa.bindparam('u')).values(pos=sa.bindparam('p')),
                     [{'u': u, 'p': i} for i, u in enumerate(uuids)])
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.alter_column('pos', existing_type=sa.Integer(), nullable=False)
        batch_op.create_index(batch_op.f('ix_gpus_pos'), ['pos'], unique=True)

    with op.batch_alter_table('layouts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('body', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('base_version', sa.BigInteger(), nullable=True))
        batch_op.alter_column('plan', existing_type=sa.JSON(), nullable=True)

    pos = {u: i for i, u in enumerate(uuids)}
    for (row_id,) in bind.execute(sa.select(layouts.c.id).order_by(layouts.c.id)).all():
        plan = bind.execute(sa.select(layouts.c.plan).where(layouts.c.id == row_id)).scalar_one()
        try:
            body = codec.encode(LayoutDoc.from_dict(plan), pos.__getitem__)
        except (PlanError, codec.CodecError):
            continue  # kept as plan JSON; read as before
        bind.execute(layouts.update().where(layouts.c.id == row_id).values(body=body, plan=None))


def downgrade() -> None:
    bind = op.get_bind()
    at = dict(bind.execute(sa.select(gpus.c.pos, gpus.c.uuid)).all())
    jobs = bind.execute(sa.select(layouts.c.job).distinct()).scalars().all()
    for job in jobs:
        base = None
        for row_id, body, base_version, plan in bind.execute(
                sa.select(layouts.c.id, layouts.c.body, layouts.c.base_version, layouts.c.plan)
                .where(layouts.c.job == job).order_by(layouts.c.version)).all():
            if body is None:
                base = LayoutDoc.from_dict(plan)
                continue
            base = codec.decode(body, at.__getitem__, base if base_version is not None else None)
            bind.execute(layouts.update().where(layouts.c.id == row_id).values(plan=base.to_dict(), body=None))
    with op.batch_alter_table('layouts', schema=None) as batch_op:
        batch_op.alter_column('plan', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column('base_version')
        batch_op.drop_column('body')
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpus_pos'))
        batch_op.drop_column('pos')
