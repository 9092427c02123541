"""agent tokens bound to a node (and optionally a client certificate)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Existing agent tokens keep working for nothing: they carry no node, and the manager refuses a
hello made with an unbound agent token (PERMISSION_DENIED, audited). Create one token per node
with `ntp-manager token create --scope agent --node NAME` and revoke the old ones.
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('node', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('fingerprint', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_column('fingerprint')
        batch_op.drop_column('node')
